"""Plain data for the capability table: each feature, the option that turns it on, and what it is on a wheel.

Every patch module names the feature it serves (``FEATURE``, one of :data:`FEATURE_KEYS`) or
:data:`VLLM_FIX` for a standalone fix of a vLLM bug; ``hybrid-kv doctor`` groups patches by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Feature(str, Enum):
    """The three features, named for what a user gets."""

    FINE_GRAINED_CPU_HITS = "fine_grained_cpu_hits"  # vLLM PR #54736
    MAMBA_SHARED_PREFIX_CHECKPOINT = "mamba_shared_prefix_checkpoint"  # vLLM PR #53945
    NIXL_SSM_SLOT_PAIRING = "nixl_ssm_slot_pairing"  # vLLM 0.27.0

    @property
    def title(self) -> str:
        return _TITLES[self]


_TITLES = {
    Feature.FINE_GRAINED_CPU_HITS: "Fine-grained hybrid prefix hits through CPU offload",
    Feature.MAMBA_SHARED_PREFIX_CHECKPOINT: "Mamba shared-prefix (junction) checkpoint under EAGLE",
    Feature.NIXL_SSM_SLOT_PAIRING: "NIXL P/D pairing of Mamba state slots",
}


class Support(str, Enum):
    NATIVE = "native"  # the wheel has it; the plugin delegates
    BACKPORT = "backport"  # the plugin adds it to this wheel
    PLUGIN = "plugin"  # the plugin's own option (no vLLM release has it): its patches go into this wheel
    UNAVAILABLE = "unavailable"  # cannot be provided on this wheel; the plugin refuses clearly


@dataclass(frozen=True)
class FeatureRow:
    """One row of doctor's table: a feature under one name, and the option a user sets for it.

    ``verdict_of``: the :class:`Feature` whose per-wheel verdict the adapter gives (native,
    backport, unavailable); None for the plugin's own options, which a wheel has exactly
    where the patches tagged with ``key`` go in."""

    key: str
    title: str
    option: str
    verdict_of: Feature | None = None


_HYBRID_KV = '--additional-config \'{"hybrid_kv": {"%s": ...}}\''
VLLM_FIX = "vllm_fix"
VLLM_FIX_TITLE = "standalone fixes of vLLM bugs"
FEATURES: tuple[FeatureRow, ...] = (
    FeatureRow(
        "fine_grained_cpu_hits",
        _TITLES[Feature.FINE_GRAINED_CPU_HITS],
        '--kv-transfer-config \'{"kv_connector": "HybridSimpleCPUConnector", ...}\' '
        "(kv_connector_extra_config.fine_grained_hits, default true; cpu_tier_eviction lru/hybrid, default lru; "
        "cpu_tier_request_ends auto/store/skip, default auto)",
        Feature.FINE_GRAINED_CPU_HITS,
    ),
    FeatureRow(
        "mamba_shared_prefix_checkpoint",
        _TITLES[Feature.MAMBA_SHARED_PREFIX_CHECKPOINT],
        _HYBRID_KV % "mamba_shared_prefix_checkpoint" + " or HYBRID_KV_MAMBA_SHARED_PREFIX_CHECKPOINT=1",
        Feature.MAMBA_SHARED_PREFIX_CHECKPOINT,
    ),
    FeatureRow(
        "nixl_ssm_slot_pairing",
        _TITLES[Feature.NIXL_SSM_SLOT_PAIRING],
        '--kv-transfer-config \'{"kv_connector": "NixlConnector", ...}\' on both instances (no switch)',
        Feature.NIXL_SSM_SLOT_PAIRING,
    ),
    FeatureRow(
        "prompt_tail_checkpoint",
        "Prompt-tail Mamba state at the last hash boundary (replay / both)",
        _HYBRID_KV % "prompt_tail_checkpoint" + " (native, replay, both; default native)",
    ),
    FeatureRow(
        "mamba_output_checkpoint",
        "Mamba state at each answer's last unit boundary (next turn reuses it)",
        _HYBRID_KV % "mamba_output_checkpoint" + " (default false)",
    ),
    FeatureRow(
        "mamba_divergence_checkpoint",
        "Mamba state where a lookup's attention hit passes its Mamba hit (no EAGLE)",
        _HYBRID_KV % "mamba_divergence_checkpoint" + " (default false)",
    ),
    FeatureRow(
        "async_load_liveness",
        "Waiting scan stays live around async KV loads and deferred block frees (vLLM fix)",
        _HYBRID_KV % "async_load_liveness" + " (default true)",
    ),
)
FEATURE_KEYS = frozenset(row.key for row in FEATURES)
# The patch that reads and validates the plugin's options at start-up serves every option.
PLUGIN_CONFIG = "plugin_config"
PLUGIN_CONFIG_TITLE = "the plugin's options, read and checked at start-up"
PATCH_TAGS = FEATURE_KEYS | {VLLM_FIX, PLUGIN_CONFIG}


@dataclass(frozen=True)
class FeatureVerdict:
    feature: Feature
    support: Support
    reason: str
