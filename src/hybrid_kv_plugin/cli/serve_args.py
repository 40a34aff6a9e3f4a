"""Validate the parts of a ``vllm serve`` command line that the plugin reads, before a GPU is involved.

Only the flags below are interpreted; everything else is left to vLLM. The verdict names
the minimum cacheable prefix and the reuse granularity of the geometry on this wheel, and,
whenever speculative decoding or the junction switch is involved, whether the junction
checkpoint would take effect and, if not, why.
"""

from __future__ import annotations

import argparse
import json
import shlex
from dataclasses import dataclass, field
from typing import Any

from hybrid_kv_plugin import CONNECTOR_NAME
from hybrid_kv_plugin.adapters import Feature
from hybrid_kv_plugin.patches.scheduler_plugin_config import check_wheel_supports
from hybrid_kv_plugin.config import (
    ENV_SHARED_PREFIX_CHECKPOINT,
    PluginConfigError,
    check_switch_needs_eagle,
    connector_options_from,
    plugin_config_from,
)

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
MAMBA_CACHE_MODES = ("none", "align", "all")
# Speculative methods whose drafter needs the last matched prefix block dropped (EAGLE-style:
# a draft position's KV depends on the next token); others keep every matched block.
EAGLE_DROP_METHODS = ("eagle", "eagle3", "mtp")
SWITCH_HINT = "--additional-config '{\"hybrid_kv\":{\"mamba_shared_prefix_checkpoint\":true}}'"


@dataclass
class ServeVerdict:
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    min_cacheable_prefix: int | None = None
    reuse_granularity: int | None = None
    mamba_cache_mode: str | None = None  # the mode vLLM would run with
    # None: not relevant (no speculative decoding, switch off); else whether the junction
    # checkpoint would act, with the reason.
    junction_checkpoint: dict[str, Any] | None = None
    # The model's geometry as vLLM resolves it (the line named a local model directory).
    geometry: dict[str, Any] | None = None


def _parser() -> argparse.ArgumentParser:
    # No abbreviations: vLLM takes none, so `--block 32` must not read as --block-size.
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--kv-transfer-config")
    p.add_argument("--additional-config")
    p.add_argument("--block-size", type=int)
    p.add_argument("--mamba-block-size", type=int)
    p.add_argument("--prefix-match-unit", type=int)
    p.add_argument("--mamba-cache-mode")
    p.add_argument("--speculative-config")
    p.add_argument("--enable-prefix-caching", action="store_true", default=None)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    # The wheels' own spellings of the junction switch (0.30: fine-grained, 0.31+: shared-prefix).
    p.add_argument("--enable-mamba-shared-prefix-checkpoint", dest="native_junction", action="store_true")
    p.add_argument("--enable-mamba-fine-grained-prefix-cache", dest="native_junction", action="store_true")
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


def _speculative(spec: dict[str, Any] | None, verdict: ServeVerdict) -> tuple[str | None, int]:
    """(method, num_speculative_tokens) of ``--speculative-config``; errors for bad values."""
    if spec is None:
        return None, 0
    method = spec.get("method")
    if method is not None and not isinstance(method, str):
        verdict.errors.append(f"--speculative-config.method: {method!r} is not a string")
        method = None
    tokens = spec.get("num_speculative_tokens", 1)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        verdict.errors.append(f"--speculative-config.num_speculative_tokens: {tokens!r} (allowed: a positive integer)")
        tokens = 1
    return method or "draft_model", tokens


def check_serve_args(argv: list[str] | str, adapter: Any) -> ServeVerdict:
    argv = shlex.split(argv) if isinstance(argv, str) else list(argv)
    args, _ = _parser().parse_known_args(argv)
    verdict = ServeVerdict()
    kv = _json(args.kv_transfer_config, "--kv-transfer-config", verdict)
    additional = _json(args.additional_config, "--additional-config", verdict)
    spec_config = _json(args.speculative_config, "--speculative-config", verdict)
    method, num_spec = _speculative(spec_config, verdict)
    switch = False
    try:
        plugin_config = plugin_config_from(additional)
        switch = plugin_config.mamba_shared_prefix_checkpoint
        check_wheel_supports(plugin_config, adapter)
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
    errors_before = len(verdict.errors)
    resolved = _resolved_geometry(argv, verdict, block_given=args.block_size is not None)
    if resolved is not None:
        block, mamba_block, unit = resolved.attention_block_size, resolved.mamba_block_size, resolved.hash_block_size
    # Where vLLM refused the geometry its message is the one error: the 16-token defaults below are not its blocks.
    geometry_refused = resolved is None and len(verdict.errors) > errors_before
    for name, size in (("--block-size", block), ("--mamba-block-size", mamba_block)):
        if size % unit and not geometry_refused:
            verdict.errors.append(f"--prefix-match-unit: {unit} must divide {name} {size}")
    if verdict.errors:
        return verdict

    caching = args.enable_prefix_caching
    if caching is False:
        verdict.mamba_cache_mode = mode
        verdict.notes.append("prefix caching is off (--no-enable-prefix-caching): no request reuses a prefix")
    else:
        if caching is None:
            verdict.notes.append(
                "prefix caching not given: vLLM turns it on only where the model supports it; "
                "pass --enable-prefix-caching to be sure"
            )
        if mode == "none":
            # vLLM's Mamba model config does the same when prefix caching is on.
            mode = "align"
            verdict.notes.append("--mamba-cache-mode not set: vLLM picks align once prefix caching is on")
        verdict.mamba_cache_mode = mode
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
    plugin_switch = switch
    switch = switch or bool(args.native_junction)
    if method is not None or switch:
        effective, reason = _junction_verdict(
            adapter, switch, method, num_spec, spec_config or {}, caching, mode, unit, mamba_block
        )
        verdict.junction_checkpoint = {"switch": switch, "effective": effective, "reason": reason}
    try:
        given = None if spec_config is None else method
        check_switch_needs_eagle(plugin_switch, given, method in EAGLE_DROP_METHODS)
    except PluginConfigError as exc:
        verdict.errors.append(f"--additional-config: {exc}")
    return verdict


def _resolved_geometry(argv: list[str], verdict: ServeVerdict, block_given: bool) -> Any:
    """The model's geometry resolved by vLLM when the line names a local model directory
    (the same resolution as ``hybrid-kv replay``); else None, with a note saying so."""
    import os

    from hybrid_kv_plugin.models.geometry import GeometryError, parse_serve_line, resolve

    try:
        serve = parse_serve_line(argv)
    except GeometryError as exc:
        verdict.errors.append(str(exc))
        return None
    if not serve.model or not os.path.isfile(os.path.join(serve.model, "config.json")):
        if not block_given:
            verdict.notes.append(
                "no local model directory (with a config.json) in the line and no --block-size: 16 assumed; "
                "vLLM derives a hybrid model's blocks from its page sizes, so name the directory to resolve them"
            )
        return None
    try:
        geometry = resolve(serve)
    except GeometryError as exc:
        verdict.errors.append(str(exc))
        return None
    verdict.geometry = geometry.as_dict()
    verdict.notes.append(
        f"geometry resolved by vLLM from {serve.model}: FA block {geometry.attention_block_size} / Mamba block "
        f"{geometry.mamba_block_size} {geometry.mamba_cache_mode} / prefix-match unit {geometry.hash_block_size}; "
        f"max model len {geometry.max_model_len}"
    )
    return geometry


def _junction_verdict(
    adapter: Any,
    switch: bool,
    method: str | None,
    num_spec: int,
    spec_config: dict[str, Any],
    caching: bool | None,
    mode: str,
    unit: int,
    mamba_block: int,
) -> tuple[bool, str]:
    """Whether the junction checkpoint would act, in the order its gate checks; the reason either way."""
    support = adapter.verdict(Feature.MAMBA_SHARED_PREFIX_CHECKPOINT)
    if not adapter.supports(Feature.MAMBA_SHARED_PREFIX_CHECKPOINT):
        return False, f"unavailable on vLLM {adapter.version}: {support.reason}"
    if method is None:
        return False, (
            "no speculative decoding: without EAGLE's dropped block the block-floored junction "
            "already serves siblings, so the switch changes nothing"
        )
    if method not in EAGLE_DROP_METHODS:
        return False, f"speculative method {method!r} keeps every matched block (no EAGLE block drop)"
    if spec_config.get("disable_eagle_block_drop"):
        return False, "disable_eagle_block_drop is set: the EAGLE block drop is off"
    if not switch:
        return False, (
            f"the switch is off; with {method} a sibling's hit stops one block short of the shared-prefix "
            f"junction, where no Mamba state is kept: turn it on with {SWITCH_HINT} "
            f"(or {ENV_SHARED_PREFIX_CHECKPOINT}=1)"
        )
    if caching is False:
        return False, "prefix caching is off"
    if mode != "align":
        return False, f"--mamba-cache-mode {mode}: the junction state is only kept in align mode"
    if unit >= mamba_block:
        return False, (
            f"partial hash hits are disabled: --prefix-match-unit {unit} is not finer than the Mamba block "
            f"{mamba_block}, so a junction inside a Mamba block is unreachable"
        )
    caveat = ""
    if method == "mtp" and num_spec > 1:
        caveat = "; if the MTP drafter has several modules it re-prefills a tail and the gate stays closed"
    how = "natively" if support.support.value == "native" else "through the plugin's backport"
    return True, (
        f"{method} drops the last matched block; the Mamba state at each shared-prefix junction "
        f"(one hash unit lower) is kept {how}, one extra state block per junction{caveat}"
    )
