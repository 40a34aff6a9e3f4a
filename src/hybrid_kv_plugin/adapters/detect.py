"""Which vLLM is installed, without importing it when package metadata suffices."""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass

SUPPORTED_RANGE = ">=0.26.0,<0.34.0"
MIN_SUPPORTED = (0, 26)
MAX_SUPPORTED = (0, 33)

_RELEASE = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?")


@dataclass(frozen=True)
class InstalledVllm:
    raw: str  # as the package metadata says it, "" when vLLM is not installed
    release: tuple[int, int, int] | None  # None for builds whose number says nothing ("dev")

    @property
    def family(self) -> tuple[int, int] | None:
        return self.release[:2] if self.release else None


def parse_release(raw: str) -> tuple[int, int, int] | None:
    """``"0.29.0"``, ``"0.29.1+cpu"``, ``"0.33.0rc1"``, ``"0.33.1.dev12+gabc"`` -> (0, 29, 0) ... ; ``"dev"`` -> None."""
    match = _RELEASE.match(raw.strip())
    if not match:
        return None
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def installed_vllm() -> InstalledVllm:
    try:
        raw = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return InstalledVllm(raw="", release=None)
    return InstalledVllm(raw=raw, release=parse_release(raw))


def probe_family() -> tuple[int, int] | None:
    """Identify a build with no usable version number by the features it has.

    Each probe is a fact listed in the adapter that owns that family; the
    newest matching family wins.
    """
    import dataclasses
    import inspect

    try:
        from vllm.config import CacheConfig, VllmConfig
        from vllm.distributed.kv_transfer.kv_connector import utils as connector_utils
        from vllm.v1.core import kv_cache_coordinator
    except Exception:
        return None
    cache_fields = {f.name for f in dataclasses.fields(CacheConfig)}
    if "enable_mamba_shared_prefix_checkpoint" in cache_fields:
        if hasattr(VllmConfig, "num_hash_lookahead_tokens"):
            return (0, 33)
        return (0, 32) if hasattr(connector_utils, "clip_ssm_state_blocks") else (0, 31)
    if "enable_mamba_fine_grained_prefix_cache" in cache_fields:
        return (0, 30)
    try:
        from vllm.v1.core.sched.output import KVConnectorBlockState  # noqa: F401
    except Exception:
        pass
    else:
        return (0, 29)
    coordinator_params = inspect.signature(kv_cache_coordinator.get_kv_cache_coordinator).parameters
    if "num_prefill_lookahead" in coordinator_params:
        return (0, 28)
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_scheduler
    except Exception:
        return (0, 26)
    return (0, 27) if hasattr(base_scheduler.NixlBaseConnectorScheduler, "get_exchange_clipped_blocks") else (0, 26)
