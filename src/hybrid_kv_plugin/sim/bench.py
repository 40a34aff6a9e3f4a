"""``hybrid-kv bench``: scheduler CPU time per step, plugin vs stock, in one process.

Only ``scheduler.schedule()`` + ``scheduler.update_from_output()`` are timed (the
connector's scheduler side runs inside them); the simulated worker, the workload
driver and the attribution observers are outside the timed region (the bench runs
without observers). ``hybrid-kv bench`` runs each configuration in a process of its
own (:class:`ConfigProcess`), one run at a time. Repeats interleave the configurations in an ABBA order (stock,
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

With ``bytecodes=True`` each configuration also runs once, untimed, under a
bytecode counter (:class:`BytecodeCounter`): the Python bytecode instructions the
same two calls execute per step. That figure is deterministic, so it compares
plugin and stock where a shared machine's timings cannot; it does not weigh what
an instruction costs (C work inside one call, cache misses).
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hybrid_kv_plugin.sim.configs import CONFIGS, ReplayConfig
from hybrid_kv_plugin.sim.replay import ReplaySettings, StepTimer, replay
from hybrid_kv_plugin.sim.workload import Segment

BENCH_CONFIGS = (CONFIGS["stock"], CONFIGS["plugin"])


@dataclass(frozen=True)
class BenchCase:
    name: str
    segments: tuple[Segment, ...]

    @property
    def requests(self) -> int:
        return sum(len(s.requests) for s in self.segments)


class BytecodeCounter:
    """Python bytecode instructions executed inside ``schedule()`` + ``update_from_output()``, per step.

    Installed like :class:`~hybrid_kv_plugin.sim.replay.StepTimer`; counts with
    ``sys.settrace`` opcode events, so it slows the calls it counts many times over
    (never combine it with timing). A tracer already installed (a debugger, coverage)
    is put back after each call.
    """

    def __init__(self) -> None:
        self.per_step: list[int] = []

    def install(self, scheduler: Any) -> None:
        import sys

        per_step = self.per_step
        count = [0]

        def on_opcode(frame: Any, event: str, arg: Any) -> Any:
            if event == "opcode":
                count[0] += 1
            return on_opcode

        def on_call(frame: Any, event: str, arg: Any) -> Any:
            frame.f_trace_lines = False
            frame.f_trace_opcodes = True
            return on_opcode

        def counted(call: Any, *args: Any) -> Any:
            # No collection inside a counted call: gc.callbacks (Hypothesis installs one for good) and
            # finalizers would run under the tracer, whenever what the process allocated before says.
            collecting = gc.isenabled()
            gc.disable()
            previous = sys.gettrace()
            sys.settrace(on_call)
            try:
                return call(*args)
            finally:
                sys.settrace(previous)
                if collecting:
                    gc.enable()

        schedule, update = scheduler.schedule, scheduler.update_from_output

        def counted_schedule() -> Any:
            count[0] = 0
            out = counted(schedule)
            per_step.append(count[0])
            return out

        def counted_update(scheduler_output: Any, model_runner_output: Any) -> Any:
            count[0] = 0
            out = counted(update, scheduler_output, model_runner_output)
            per_step[-1] += count[0]
            return out

        scheduler.schedule = counted_schedule
        scheduler.update_from_output = counted_update


def count_bytecodes(case: BenchCase, settings: ReplaySettings, config: ReplayConfig) -> tuple[int, int] | None:
    """(bytecode instructions, steps) of one untimed run's scheduler steps (None: the configuration is refused)."""
    counter = BytecodeCounter()
    result = replay(case.segments, settings, config, observe=False, per_request=False, timer=counter)
    if result.refused is not None:
        return None
    return sum(counter.per_step), result.steps


def _spread(values: Sequence[float], digits: int) -> dict[str, float]:
    return {
        "min": round(min(values), digits),
        "median": round(statistics.median(values), digits),
        "max": round(max(values), digits),
    }


# One timed run: (why the configuration was refused, or None; its deterministic facts; CPU seconds per step).
TimedRun = tuple["str | None", dict[str, Any], list[float]]


def timed_run(
    segments: Sequence[Segment],
    settings: ReplaySettings,
    config: ReplayConfig,
    clock: Callable[[], float] | None = None,
) -> TimedRun:
    timer = StepTimer(clock)
    try:
        result = replay(segments, settings, config, observe=False, per_request=False, timer=timer)
    finally:
        gc.unfreeze()  # the timer froze the heap once the engine was built
    if result.refused is not None:
        return result.refused, {}, []
    observed = {
        "requests": result.requests,
        "steps": result.steps,
        "ideal_tokens": result.ideal_tokens,
        "reused_tokens": result.reused_tokens,
        "efficiency": round(result.efficiency, 4),
    }
    return None, observed, timer.per_step


class ConfigProcess:
    """One configuration's timed runs in a Python process of its own, as a server runs one engine.

    Timing two configurations in one interpreter charges each for the other: installing
    and removing the plugin's patches around every run, and the other configuration's
    objects, cost the plugin's steps ~3 % more machine instructions on 0.29 (callgrind:
    905.7k per step in a fresh process, 933.4k after two stock runs) and stock's ~1 %. The
    process registers the plugin once (plugin configurations) and keeps it; it talks
    over two pipes of its own, so vLLM's log output on stdout / stderr stays the caller's.
    """

    def __init__(self, segments: Sequence[Segment], settings: ReplaySettings, config: ReplayConfig) -> None:
        import os
        import subprocess
        import sys
        from multiprocessing.connection import Connection

        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        code = "import sys; from hybrid_kv_plugin.sim.bench import serve_timed_runs; serve_timed_runs(*map(int, sys.argv[1:]))"
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", code, str(to_child_r), str(from_child_w)],
                pass_fds=(to_child_r, from_child_w),
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            for fd in (to_child_r, to_child_w, from_child_r, from_child_w):
                os.close(fd)
            raise
        os.close(to_child_r)
        os.close(from_child_w)
        self.name = config.name
        self._send = Connection(to_child_w, readable=False)
        self._receive = Connection(from_child_r, writable=False)
        try:
            self._send.send((tuple(segments), settings, config))
        except BaseException:
            self.close()  # the process died before taking its work (or we were interrupted): reap it
            raise

    def run(self) -> TimedRun:
        self._send.send("run")
        try:
            status, payload = self._receive.recv()
        except EOFError:
            raise RuntimeError(f"bench: the {self.name} process exited ({self.process.wait()})") from None
        if status != "ok":
            raise RuntimeError(f"bench: the {self.name} run failed in its process:\n{payload}")
        return payload

    def close(self) -> None:
        """Stop the process and reap it (killed if it does not stop within a minute)."""
        import subprocess

        try:
            self._send.send(None)
        except OSError:
            pass  # already gone
        self._send.close()
        self._receive.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def serve_timed_runs(read_fd: int, write_fd: int) -> None:
    """The body of a :class:`ConfigProcess`: one timed run per request until told to stop."""
    import traceback
    from multiprocessing.connection import Connection

    import hybrid_kv_plugin

    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    segments, settings, config = inbox.recv()
    if config.plugin:
        hybrid_kv_plugin.register()  # once; replay() keeps a registration it finds
    while inbox.recv() is not None:
        try:
            outbox.send(("ok", timed_run(segments, settings, config)))
        except Exception:
            outbox.send(("error", traceback.format_exc()))


def run_case(
    case: BenchCase,
    settings: ReplaySettings,
    repeats: int,
    configs: Sequence[ReplayConfig] = BENCH_CONFIGS,
    clock: Callable[[], float] | None = None,
    progress: Callable[[str, int], None] | None = None,
    bytecodes: bool = False,
    processes: bool = False,
) -> dict[str, Any]:
    """Every configuration ``repeats`` times, ABBA-interleaved; ``configs[0]`` is the baseline.

    ``processes``: each configuration runs in its own :class:`ConfigProcess` (one run at a
    time; ``clock`` must then be None); otherwise all run in this interpreter.
    ``bytecodes``: one more, untimed run per configuration under :class:`BytecodeCounter`.
    """
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    if processes and clock is not None:
        raise ValueError("a clock cannot be passed to configuration processes")
    # Per configuration, per repeat: the CPU seconds of each step, in order.
    step_times: dict[str, list[list[float]]] = {c.name: [] for c in configs}
    facts: dict[str, dict[str, Any]] = {}
    workers: dict[str, ConfigProcess] = {}
    try:
        for config in configs if processes else ():
            workers[config.name] = ConfigProcess(case.segments, settings, config)
        for repeat in range(repeats):
            order = list(configs) if repeat % 2 == 0 else list(reversed(configs))
            for config in order:
                if "refused" in facts.get(config.name, {}):
                    continue
                if processes:
                    refused, observed, per_step = workers[config.name].run()
                else:
                    refused, observed, per_step = timed_run(case.segments, settings, config, clock)
                if progress:
                    progress(f"{case.name} {config.name} #{repeat + 1}", case.requests)
                if refused is not None:
                    facts[config.name] = {"refused": refused}
                    continue
                if config.name in facts and facts[config.name] != observed:
                    raise RuntimeError(f"{case.name}/{config.name}: repeat {repeat + 1} is not deterministic")
                facts[config.name] = observed
                step_times[config.name].append(per_step)
    finally:
        for worker in workers.values():
            worker.close()
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
    if bytecodes:
        for config in configs:
            if "refused" in facts[config.name]:
                continue
            counted = count_bytecodes(case, settings, config)
            if progress:
                progress(f"{case.name} {config.name} bytecodes", case.requests)
            assert counted is not None  # the timed runs were not refused
            total, steps = counted
            if steps != facts[config.name]["steps"]:
                raise RuntimeError(f"{case.name}/{config.name}: the counted run is not the timed runs' ({steps} steps)")
            out["configs"][config.name]["bytecodes_per_step"] = round(total / steps, 1)
    for config in configs[1:]:
        pairs = list(zip(per_step[config.name], per_step[baseline]))
        if pairs:
            ratios = [ours / theirs if theirs else float("nan") for ours, theirs in pairs]
            out[f"ratio_{config.name}_vs_{baseline}"] = {**_spread(ratios, 4), "per_repeat": [round(r, 4) for r in ratios]}
            theirs = floors[baseline]
            out[f"floor_ratio_{config.name}_vs_{baseline}"] = round(floors[config.name] / theirs, 4) if theirs else float("nan")
        ours_bc = out["configs"][config.name].get("bytecodes_per_step")
        theirs_bc = out["configs"][baseline].get("bytecodes_per_step")
        if ours_bc and theirs_bc:
            out[f"bytecode_ratio_{config.name}_vs_{baseline}"] = round(ours_bc / theirs_bc, 4)
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
    bytecodes: bool = False,
    processes: bool = False,
) -> dict[str, Any]:
    from hybrid_kv_plugin.registration import current_adapter
    from hybrid_kv_plugin.sim.engine import async_by_default

    if settings.async_scheduling is None:  # chosen here, so configuration processes run the same
        settings = dataclasses.replace(settings, async_scheduling=async_by_default())
    return {
        "vllm": current_adapter().version,
        "repeats": repeats,
        "timed": "process CPU time of scheduler.schedule() + scheduler.update_from_output()",
        "processes": "one per configuration" if processes else "this one",
        "scheduler": "AsyncScheduler" if settings.async_scheduling else "Scheduler",
        "cases": [
            run_case(
                case, settings, repeats, configs=configs, clock=clock, progress=progress, bytecodes=bytecodes,
                processes=processes,
            )
            for case in cases
        ],
    }
