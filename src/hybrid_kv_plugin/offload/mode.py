"""Which SimpleCPU behaviour one ``HybridSimpleCPUConnector`` runs, decided once at construction."""

from __future__ import annotations

from enum import Enum
from typing import Any

from hybrid_kv_plugin.adapters.capabilities import Feature, Support
from hybrid_kv_plugin.config import PluginConfigError


class OffloadMode(str, Enum):
    STOCK = "stock"  # the wheel's SimpleCPU connector, unchanged
    NATIVE = "native"  # the wheel's SimpleCPU connector, which has the feature itself
    BACKPORT = "backport"  # the plugin's scheduler side (hybrid_kv_plugin.offload.fine_grained_scheduler)


def _mamba_modes(kv_cache_config: Any) -> tuple[set[str], bool]:
    """(cache modes of the Mamba groups, whether any other group exists)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    specs = [g.kv_cache_spec for g in getattr(kv_cache_config, "kv_cache_groups", None) or ()]
    modes = {s.mamba_cache_mode for s in specs if isinstance(s, MambaSpec)}
    return modes, any(not isinstance(s, MambaSpec) for s in specs)


def is_hybrid(kv_cache_config: Any) -> bool:
    """Attention + Mamba groups: per-group block geometry matters (the backport fixes it for every cache mode)."""
    modes, has_other = _mamba_modes(kv_cache_config)
    return bool(modes) and has_other


def is_hybrid_align(kv_cache_config: Any) -> bool:
    """Attention + Mamba ``align``: the layout whose CPU hits can end inside a Mamba block."""
    modes, has_other = _mamba_modes(kv_cache_config)
    return "align" in modes and has_other


def choose_mode(adapter: Any, options: Any, vllm_config: Any, kv_cache_config: Any) -> OffloadMode:
    """Stock for non-hybrid models, without prefix caching, or when the user opts out;
    otherwise the wheel's native feature, the backport, or a start-up refusal."""
    verdict = adapter.verdict(Feature.FINE_GRAINED_CPU_HITS)
    if verdict.support is Support.NATIVE:
        return OffloadMode.NATIVE
    relevant = (
        options.fine_grained_hits
        and vllm_config.cache_config.enable_prefix_caching
        and is_hybrid(kv_cache_config)
    )
    if not relevant:
        return OffloadMode.STOCK
    if verdict.support is Support.BACKPORT:
        return OffloadMode.BACKPORT
    if not is_hybrid_align(kv_cache_config):
        return OffloadMode.STOCK  # no Mamba align group: nothing fine-grained to refuse
    raise PluginConfigError(
        f"hybrid-kv-plugin: HybridSimpleCPUConnector cannot serve fine-grained hybrid prefix hits on "
        f"vLLM {adapter.version}: {verdict.reason}. Upgrade vLLM, or set "
        '"fine_grained_hits": false in kv_connector_extra_config to run the stock SimpleCPU connector.'
    )
