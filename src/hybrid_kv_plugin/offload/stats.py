"""Boundary-store counters: one admission outcome per Mamba boundary hand-off offered to SimpleCPU.

A declined hand-off is silent by nature (the boundary is simply not offloaded and
a later request misses), so every decline reason is counted. The dataclass is the
plugin's own and has the same fields on every wheel; on wheels with the native
counters (0.30+) it is filled from vLLM's ``BoundaryStoreStats`` field by field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any


class StoreOutcome(str, Enum):
    """What happened to one store candidate; the value is the counter / metric label."""

    STORED = "stored"
    DROPPED_CPU_FULL = "dropped_cpu_full"
    DROPPED_REQUEST_GONE = "dropped_request_gone"
    DROPPED_NULL_BLOCK = "dropped_null_block"
    DROPPED_NOT_HASHED = "dropped_not_hashed"
    SKIPPED_ALREADY_CACHED = "skipped_already_cached"
    SKIPPED_IN_FLIGHT = "skipped_in_flight"
    # ``cpu_tier_request_ends: skip`` kept it off the tier (offload/admission.py); the plugin's own.
    DECLINED_REQUEST_END = "declined_request_end"


# Each outcome's label, which is also its counter field (the metrics read the growth every step).
OUTCOME_LABELS = tuple(o.value for o in StoreOutcome)


@dataclass
class BoundaryStoreStats:
    """Cumulative since start-up or the last CPU-cache reset. ``published`` = sum of the outcomes."""

    published: int = 0
    stored: int = 0
    dropped_cpu_full: int = 0
    dropped_request_gone: int = 0
    dropped_null_block: int = 0
    dropped_not_hashed: int = 0
    skipped_already_cached: int = 0
    skipped_in_flight: int = 0
    declined_request_end: int = 0

    def add(self, counts: dict[str, int]) -> None:
        """Add ``{outcome label: n}`` (labels as in :data:`OUTCOME_LABELS`; ``published`` grows by each n)."""
        for label, n in counts.items():
            self.published += n
            setattr(self, label, getattr(self, label) + n)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def copy(self) -> BoundaryStoreStats:
        """A snapshot (every field is an int); cheaper than ``dataclasses.replace``."""
        return BoundaryStoreStats(**self.__dict__)

    @classmethod
    def from_native(cls, native: Any) -> BoundaryStoreStats:
        """Translate vLLM's own ``BoundaryStoreStats`` (0.30+); a field it lacks reads 0."""
        if native is None:
            return cls()
        # On 0.30 this runs on every step whose counters moved (the metrics diff them).
        return cls(**{name: int(getattr(native, name, 0)) for name in _FIELD_NAMES})


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(BoundaryStoreStats))
