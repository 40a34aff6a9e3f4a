"""``hybrid-kv bench``: scheduler CPU time per step, plugin vs stock, in one process.

Only ``scheduler.schedule()`` + ``scheduler.update_from_output()`` are timed (the
connector's scheduler side runs inside them); the simulated worker, the workload
driver and the attribution observers are outside the timed region (the bench runs
without observers). Repeats interleave the configurations in an ABBA order (stock,
plugin, plugin, stock, ...), so slow drifts of a shared machine hit both alike. Two
figures: the per-repeat ratio plugin / stock of CPU seconds per step (min / median /
max), and the ratio of the *per-step floors*. A run's steps are deterministic, so
step k does the same work in every repeat; its minimum over the repeats is its cost
with the least interference (a shared machine only ever adds time), and the floor
of a configuration is the mean of those minima. On a 2-core VM whose per-repeat
ratios spread over +-30 %, the floor ratio moves by a few percent between runs. As in a vLLM engine, the start-up heap is frozen out of the
garbage collector before the first step: a full collection of it takes ~1 s here and,
landing in a timed step, made single repeats ~14x slower. Step counts and reuse are deterministic and repeat-invariant;
timings are not and are never asserted by the tests.
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hybrid_kv_plugin.sim.replay import CONFIGS, ReplayConfig, ReplaySettings, StepTimer, replay
from hybrid_kv_plugin.sim.workload import Segment

BENCH_CONFIGS = (CONFIGS["stock"], CONFIGS["plugin"])


@dataclass(frozen=True)
class BenchCase:
    name: str
    segments: tuple[Segment, ...]

    @property
    def requests(self) -> int:
        return sum(len(s.requests) for s in self.segments)


def _spread(values: Sequence[float], digits: int) -> dict[str, float]:
    return {
        "min": round(min(values), digits),
        "median": round(statistics.median(values), digits),
        "max": round(max(values), digits),
    }


def run_case(
    case: BenchCase,
    settings: ReplaySettings,
    repeats: int,
    configs: Sequence[ReplayConfig] = BENCH_CONFIGS,
    clock: Callable[[], float] | None = None,
    progress: Callable[[str, int], None] | None = None,
) -> dict[str, Any]:
    """Every configuration ``repeats`` times, ABBA-interleaved; ``configs[0]`` is the baseline."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    # Per configuration, per repeat: the CPU seconds of each step, in order.
    step_times: dict[str, list[list[float]]] = {c.name: [] for c in configs}
    facts: dict[str, dict[str, Any]] = {}
    for repeat in range(repeats):
        order = list(configs) if repeat % 2 == 0 else list(reversed(configs))
        for config in order:
            timer = StepTimer(clock)
            try:
                result = replay(case.segments, settings, config, observe=False, per_request=False, timer=timer)
            finally:
                gc.unfreeze()  # the timer froze the heap once the engine was built
            if progress:
                progress(f"{case.name} {config.name} #{repeat + 1}", case.requests)
            if result.refused is not None:
                facts[config.name] = {"refused": result.refused}
                continue
            observed = {
                "requests": result.requests,
                "steps": result.steps,
                "ideal_tokens": result.ideal_tokens,
                "reused_tokens": result.reused_tokens,
                "efficiency": round(result.efficiency, 4),
            }
            if config.name in facts and facts[config.name] != observed:
                raise RuntimeError(f"{case.name}/{config.name}: repeat {repeat + 1} is not deterministic")
            facts[config.name] = observed
            step_times[config.name].append(timer.per_step)
    baseline = configs[0].name
    per_step = {name: [sum(run) / max(len(run), 1) for run in runs] for name, runs in step_times.items()}
    floors = {name: _floor(runs) for name, runs in step_times.items() if runs}
    out: dict[str, Any] = {"name": case.name, "requests": case.requests, "configs": {}}
    for config in configs:
        entry = dict(facts[config.name])
        if per_step[config.name]:
            entry["step_cpu_us"] = _spread([1e6 * t for t in per_step[config.name]], 2)
            entry["step_floor_us"] = round(1e6 * floors[config.name], 2)
        out["configs"][config.name] = entry
    for config in configs[1:]:
        pairs = list(zip(per_step[config.name], per_step[baseline]))
        if pairs:
            ratios = [ours / theirs if theirs else float("nan") for ours, theirs in pairs]
            out[f"ratio_{config.name}_vs_{baseline}"] = {**_spread(ratios, 4), "per_repeat": [round(r, 4) for r in ratios]}
            theirs = floors[baseline]
            out[f"floor_ratio_{config.name}_vs_{baseline}"] = round(floors[config.name] / theirs, 4) if theirs else float("nan")
    return out


def _floor(runs: Sequence[Sequence[float]]) -> float:
    """Mean over the steps of each step's minimum over the repeats (every repeat has the same steps)."""
    steps = len(runs[0])
    return sum(min(run[k] for run in runs) for k in range(steps)) / max(steps, 1)


def run_bench(
    cases: Sequence[BenchCase],
    settings: ReplaySettings,
    repeats: int = 5,
    clock: Callable[[], float] | None = None,
    progress: Callable[[str, int], None] | None = None,
    configs: Sequence[ReplayConfig] = BENCH_CONFIGS,
) -> dict[str, Any]:
    from hybrid_kv_plugin.registration import current_adapter

    return {
        "vllm": current_adapter().version,
        "repeats": repeats,
        "timed": "process CPU time of scheduler.schedule() + scheduler.update_from_output()",
        "cases": [run_case(case, settings, repeats, configs=configs, clock=clock, progress=progress) for case in cases],
    }
