"""The versioned adapter layer: pick one adapter for the installed vLLM, or say why none fits.

Version numbers are compared here and nowhere else. The families are the ``vllm_<major>_<minor>``
modules of this package (:mod:`.families` finds them); nothing else lists them.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid_kv_plugin.adapters.base import VllmAdapter
from hybrid_kv_plugin.adapters.capabilities import Feature, FeatureVerdict, Support
from hybrid_kv_plugin.adapters.detect import SUPPORTED_RANGE, InstalledVllm, installed_vllm, parse_release, probe_family
from hybrid_kv_plugin.adapters.families import ADAPTERS, first_wheel_where


@dataclass(frozen=True)
class AdapterSelection:
    adapter: VllmAdapter | None
    installed: InstalledVllm
    reason: str  # how the adapter was chosen, or why none was


def adapter_for_family(family: tuple[int, int], version: str) -> VllmAdapter | None:
    for cls in ADAPTERS:
        if family in cls.families:
            return cls(version)
    return None


def select_adapter(installed: InstalledVllm | None = None) -> AdapterSelection:
    installed = installed_vllm() if installed is None else installed
    if not installed.raw:
        return AdapterSelection(None, installed, "vLLM is not installed")
    family = installed.family
    how = "package metadata"
    if family is None:
        family = probe_family()
        how = "feature probes (the version string carries no release number)"
        if family is None:
            return AdapterSelection(None, installed, f"vLLM {installed.raw!r}: no known feature set found")
    adapter = adapter_for_family(family, installed.raw)
    if adapter is None:
        return AdapterSelection(
            None, installed, f"vLLM {installed.raw} is outside the supported range {SUPPORTED_RANGE}"
        )
    return AdapterSelection(adapter, installed, f"vLLM {installed.raw} via {how}")


__all__ = [
    "ADAPTERS",
    "AdapterSelection",
    "Feature",
    "FeatureVerdict",
    "Support",
    "VllmAdapter",
    "adapter_for_family",
    "first_wheel_where",
    "parse_release",
    "select_adapter",
]
