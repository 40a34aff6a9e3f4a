"""Plain data for the capability table: what each feature is on a wheel, and why."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Feature(str, Enum):
    """The three features, named for what a user gets."""

    FINE_GRAINED_CPU_HITS = "fine_grained_cpu_hits"  # vLLM PR #54736
    MAMBA_JUNCTION_CHECKPOINT = "mamba_junction_checkpoint"  # vLLM PR #53945
    NIXL_SSM_SLOT_PAIRING = "nixl_ssm_slot_pairing"  # vLLM 0.27.0

    @property
    def title(self) -> str:
        return _TITLES[self]


_TITLES = {
    Feature.FINE_GRAINED_CPU_HITS: "Fine-grained hybrid prefix hits through CPU offload",
    Feature.MAMBA_JUNCTION_CHECKPOINT: "Mamba shared-prefix (junction) checkpoint under EAGLE",
    Feature.NIXL_SSM_SLOT_PAIRING: "NIXL P/D pairing of Mamba state slots",
}


class Support(str, Enum):
    NATIVE = "native"  # the wheel has it; the plugin delegates
    BACKPORT = "backport"  # the plugin adds it to this wheel
    UNAVAILABLE = "unavailable"  # cannot be provided on this wheel; the plugin refuses clearly


@dataclass(frozen=True)
class FeatureVerdict:
    feature: Feature
    support: Support
    reason: str
