"""Prometheus export of the boundary-store outcomes on wheels without native SimpleCPU metrics (0.29, 0.30).

The series has the native name and labels of vLLM 0.31+
(``vllm:simple_kv_offload_save_outcomes_total{outcome=...}``), so dashboards keep
working when a deployment moves to a newer wheel. The values travel through
vLLM's own connector-stats channel: the scheduler side returns the per-step
growth from ``get_kv_connector_stats()``, vLLM aggregates and hands it to the
connector class's ``build_prom_metrics()`` object, which increments the counter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from hybrid_kv_plugin.offload.stats import OUTCOME_LABELS

SAVE_OUTCOMES = "vllm:simple_kv_offload_save_outcomes_total"
SAVE_OUTCOMES_HELP = (
    "Store admission decisions of SimpleCPU offload for Mamba boundary hand-offs, by outcome "
    "(exported by hybrid-kv-plugin on wheels without the native series)."
)
_OUTCOMES = frozenset(OUTCOME_LABELS)


@dataclass
class OffloadOutcomeStats(KVConnectorStats):
    """``data`` = ``{outcome label: count}``: plain strings and ints, so it crosses process boundaries."""

    def __post_init__(self) -> None:
        unknown = set(self.data) - _OUTCOMES
        if unknown:
            raise ValueError(f"unknown SimpleCPU store outcome(s) {sorted(unknown)}")

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for outcome, n in other.data.items():
            self.data[outcome] = self.data.get(outcome, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        return {f"{SAVE_OUTCOMES}:{outcome}": n for outcome, n in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class OffloadOutcomePromMetrics(KVConnectorPromMetrics):
    """Registers the outcome counter once per process and increments one child per (engine, outcome)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._outcomes = self._counter_cls(
            name=SAVE_OUTCOMES, documentation=SAVE_OUTCOMES_HELP, labelnames=[*labelnames, "outcome"]
        )
        self._children: dict[tuple[int, str], Any] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for outcome, n in transfer_stats_data.items():
            if outcome not in _OUTCOMES or not n:
                continue
            child = self._children.get((engine_idx, outcome))
            if child is None:
                labels = [*self.per_engine_labelvalues[engine_idx], outcome]
                child = self._children[(engine_idx, outcome)] = self._outcomes.labels(*labels)
            child.inc(n)
