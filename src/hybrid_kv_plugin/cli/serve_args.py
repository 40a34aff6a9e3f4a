"""Validate the parts of a ``vllm serve`` command line that the plugin reads, before a GPU is involved.

Only the flags below are interpreted; everything else is left to vLLM. The verdict names
the minimum cacheable prefix and the reuse granularity of the geometry on this wheel.
"""

from __future__ import annotations

import argparse
import json
import shlex
from dataclasses import dataclass, field
from typing import Any

from hybrid_kv_plugin import CONNECTOR_NAME
from hybrid_kv_plugin.adapters import Feature
from hybrid_kv_plugin.config import PluginConfigError, connector_options_from, plugin_config_from

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
MAMBA_CACHE_MODES = ("none", "align", "all")


@dataclass
class ServeVerdict:
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    min_cacheable_prefix: int | None = None
    reuse_granularity: int | None = None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--kv-transfer-config")
    p.add_argument("--additional-config")
    p.add_argument("--block-size", type=int)
    p.add_argument("--mamba-block-size", type=int)
    p.add_argument("--prefix-match-unit", type=int)
    p.add_argument("--mamba-cache-mode")
    p.add_argument("--speculative-config")
    p.add_argument("--enable-prefix-caching", action="store_true", default=None)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    return p


def _json(value: str | None, flag: str, verdict: ServeVerdict) -> dict[str, Any] | None:
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        verdict.errors.append(f"{flag}: not valid JSON ({exc.msg} at column {exc.colno})")
        return None
    if not isinstance(parsed, dict):
        verdict.errors.append(f"{flag}: must be a JSON object")
        return None
    return parsed


def check_serve_args(argv: list[str] | str, adapter: Any) -> ServeVerdict:
    argv = shlex.split(argv) if isinstance(argv, str) else list(argv)
    args, _ = _parser().parse_known_args(argv)
    verdict = ServeVerdict()
    kv = _json(args.kv_transfer_config, "--kv-transfer-config", verdict)
    additional = _json(args.additional_config, "--additional-config", verdict)
    _json(args.speculative_config, "--speculative-config", verdict)
    try:
        plugin_config_from(additional)
    except PluginConfigError as exc:
        verdict.errors.append(f"--additional-config: {exc}")
    uses_plugin_connector = bool(kv) and kv.get("kv_connector") == CONNECTOR_NAME
    fine_grained = False
    if kv is not None:
        if kv.get("kv_role") not in KV_ROLES:
            verdict.errors.append(
                f"--kv-transfer-config.kv_role: {kv.get('kv_role')!r} (allowed: {', '.join(KV_ROLES)})"
            )
        if uses_plugin_connector:
            try:
                options = connector_options_from(kv.get("kv_connector_extra_config"), adapter.simplecpu_stock_keys)
                fine_grained = options.fine_grained_hits
            except PluginConfigError as exc:
                verdict.errors.append(f"--kv-transfer-config: {exc}")
    mode = args.mamba_cache_mode or "none"
    if mode not in MAMBA_CACHE_MODES:
        verdict.errors.append(f"--mamba-cache-mode: {mode!r} (allowed: {', '.join(MAMBA_CACHE_MODES)})")
    block = args.block_size or 16
    mamba_block = args.mamba_block_size or block
    unit = args.prefix_match_unit or block
    for name, size in (("--block-size", block), ("--mamba-block-size", mamba_block)):
        if size % unit:
            verdict.errors.append(f"--prefix-match-unit: {unit} must divide {name} {size}")
    if verdict.errors:
        return verdict
    # Granularity of a hit: the prefix-match unit where Mamba states exist at hash
    # boundaries (align mode + fine-grained support), else whole Mamba blocks.
    fine_ok = mode == "align" and (
        not uses_plugin_connector or (fine_grained and adapter.supports(Feature.FINE_GRAINED_CPU_HITS))
    )
    verdict.reuse_granularity = unit if fine_ok else max(mamba_block, block)
    verdict.min_cacheable_prefix = verdict.reuse_granularity
    if uses_plugin_connector and fine_grained and not adapter.supports(Feature.FINE_GRAINED_CPU_HITS):
        verdict.notes.append(
            f"{CONNECTOR_NAME} fine-grained hits are unavailable on vLLM {adapter.version} "
            "(needs >= 0.29.0): set kv_connector_extra_config.fine_grained_hits=false or upgrade"
        )
    return verdict
