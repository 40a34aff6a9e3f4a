"""``hybrid-kv replay``: what a workload would reuse on this wheel, stock vs plugin, on a CPU.

The runner: reads the inputs (:mod:`.replay_inputs`), runs each configuration, and hands the
report to :mod:`.report` (text), :mod:`.compare` (``--compare``) or :mod:`.plot` (``--plot``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from hybrid_kv_plugin.cli.args import (
    CONFIG_NAMES,
    COLD_REPLAY_CONFIGS,
    DEFAULT_PLUGIN_CONFIGS,
    DEFAULT_STOCK_CONFIGS,
    add_geometry_arguments,
    choose_configs,
    settings_from,
)
from hybrid_kv_plugin.cli.errors import fail


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", metavar="FILE.jsonl", help="JSONL trace (see README); default: the embedded workload")
    parser.add_argument("--seed", type=int, default=0, help="seed of the embedded workload")
    parser.add_argument("--scale", type=int, default=1, help="size multiplier of the embedded workload (31 requests each)")
    parser.add_argument(
        "--configs",
        default=None,
        help=f"comma-separated, from {', '.join(CONFIG_NAMES)}; plugin+junction is the plugin with the "
        "mamba_shared_prefix_checkpoint switch on, plugin+tail-X the plugin with prompt_tail_checkpoint X, "
        "plugin+output-checkpoint the plugin with mamba_output_checkpoint on "
        f"(default: {','.join((*DEFAULT_STOCK_CONFIGS, *DEFAULT_PLUGIN_CONFIGS))}, plus plugin+junction when "
        f"a segment runs EAGLE; with --cold-replay: {','.join(COLD_REPLAY_CONFIGS)})",
    )
    parser.add_argument(
        "--cold-replay",
        action="store_true",
        help="run every request twice, the GPU prefix cache evicted in between, and report the replay "
        "external hit (CPU-tier hit tokens / prompt tokens of the second pass) per configuration",
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="stop with exit 2 at the first request vLLM would refuse (too long for the model); by default "
        "such requests are counted per reason and left out, as a server answers them with an error",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="run up to N configurations at once, each in a process of its own (default 1: one after "
        "another in this process); the numbers are the same, the run takes about as long as its slowest "
        "configuration when N cores are free, and each process holds its own copy of the trace",
    )
    add_geometry_arguments(parser)
    from hybrid_kv_plugin.cli import replay_inputs

    replay_inputs.add_arguments(parser)
    from hybrid_kv_plugin.cli import cluster

    cluster.add_arguments(parser)
    parser.add_argument(
        "--tier-ceiling",
        action="store_true",
        help="also report what a CPU tier of this size can keep of the workload's reuse in a block model "
        "(attention only, requests one after another): under LRU and under the offline optimum, and the tier "
        "each needs for 0.90 / 0.95 of it; takes seconds",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="machine-readable output")
    out.add_argument("--per-request", action="store_true", help="with --json: every request's ideal, reuse and loss")
    out.add_argument("--plot", metavar="FILE.png", help="bar chart of reused vs ideal per configuration (needs matplotlib)")
    out.add_argument(
        "--compare",
        nargs="+",
        metavar="REPORT.json",
        help="render saved `replay --json` reports side by side (one per wheel) and exit; runs nothing",
    )


def run_replay_command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    if args.compare:
        from hybrid_kv_plugin.cli.compare import render_comparison

        return render_comparison(args.compare, out)
    from hybrid_kv_plugin.cli import cluster

    jobs = getattr(args, "jobs", 1)
    if jobs < 1:
        fail(f"--jobs must be >= 1, got {jobs}")
    if cluster.requested(args) and getattr(args, "tier_ceiling", False):
        fail("--tier-ceiling models the CPU tier of one engine; it does not apply with --engines")
    if jobs > 1 and cluster.requested(args):
        fail("--jobs runs the configurations of a single-engine replay in parallel; it does not apply with --engines")
    if cluster.requested(args):  # --engines N > 1: the cluster runner (cli/cluster.py)
        return cluster.run_cluster_command(args, out)
    started = _wall()
    from hybrid_kv_plugin.cli import replay_inputs as inputs

    inputs.check_flags(args)
    if args.plot:
        from hybrid_kv_plugin.cli.plot import require_matplotlib

        require_matplotlib()
    segments = inputs.load_segments(args)
    settings = settings_from(args)
    configs = choose_configs(args.configs, segments, cold_replay=args.cold_replay)
    model, settings, segments, refused, pool_notes = inputs.prepare_inputs(args, settings, segments)
    next_steps = inputs.next_steps(settings, model, args)
    for note in pool_notes:
        if "warning" in note:
            print(f"hybrid-kv: {note}", file=sys.stderr)
    total = sum(len(s.requests) for s in segments)
    # --cold-replay sums the replay pass from the full per-request rows.
    rows = args.per_request or args.cold_replay
    labels = [f"{config.name} [{number}/{len(configs)}]" for number, config in enumerate(configs, start=1)]
    if jobs > 1 and len(configs) > 1:
        startup = _wall() - started
        results, timings = _run_in_processes(segments, settings, configs, labels, rows, jobs)
    else:
        for config in configs:
            _warm_up(config)
        startup = _wall() - started
        results, timings = [], []
        for label, config in zip(labels, configs):
            result, timing = _run_config(segments, settings, config, label, rows)
            results.append(result)
            timings.append(timing)
    from hybrid_kv_plugin.cli.report import build_report, render_report

    report = build_report(segments, settings, results, per_request=args.per_request, model=model)
    report["startup_s"] = round(startup, 1)
    for row, timing in zip(report["results"], timings):
        row["timing"] = timing
    inputs.add_input_notes(report, refused, pool_notes, model)
    if getattr(args, "tier_ceiling", False):
        from hybrid_kv_plugin.sim.tier_ceiling import tier_ceiling

        ceiling = tier_ceiling(segments, settings.attention_block_size, settings.cpu_blocks)
        report["tier_ceiling"] = ceiling.as_dict(model.cpu_bytes / model.cpu_blocks if model and model.cpu_blocks else None)
    elif (hint := inputs.tier_size_hint(report["results"])) is not None:
        next_steps.append(hint)
    if next_steps:
        report["next_steps"] = next_steps
    if args.cold_replay:
        from hybrid_kv_plugin.sim.cold_replay import replay_external_hit

        for summary, result in zip(report["results"], results):
            summary["replay_external_hit"] = replay_external_hit(result)
    if args.plot:
        from hybrid_kv_plugin.cli.plot import plot_report

        plot_report(report, args.plot)
    if args.json:
        out.write(json.dumps(report, indent=2) + "\n")
    else:
        render_report(report, out)
        if args.plot:
            out.write(f"\nplot written to {args.plot}\n")
    return 0


def _run_config(segments: list[Any], settings: Any, config: Any, label: str, rows: bool) -> tuple[Any, dict[str, Any]]:
    """One configuration's replay and its timing, with its own progress lines on stderr."""
    import gc
    import time

    from hybrid_kv_plugin.cli.progress import Progress
    from hybrid_kv_plugin.sim.replay import replay

    total = sum(len(s.requests) for s in segments)
    progress = Progress(total, lines=True)
    progress.start(label, total)
    # As vLLM's engine core does once started (``freeze_gc_heap``): what exists now (imports, the
    # trace) leaves the collector's view for the run, so its full collections scan what the run
    # allocates, not the whole heap (about a tenth of a replay's CPU otherwise).
    gc.collect()
    gc.freeze()
    # No StepTimer here: its process-CPU clock costs a system call per step (up to a third of
    # a long replay's time on a busy machine); steps/s is steps over wall time.
    started, cpu_started = _wall(), time.process_time()
    try:
        result = replay(segments, settings, config, progress=progress.update, per_request=rows)
    finally:
        gc.unfreeze()
    timing = _timing(_wall() - started, total, result.steps, time.process_time() - cpu_started)
    progress.close()
    return result, timing


def _child_run(segments: list[Any], settings: Any, config: Any, label: str, rows: bool) -> tuple[Any, dict[str, Any]]:
    """``--jobs``: one configuration in a process of its own, warmed up there first (its wall time
    and peak RSS are that process's, start-up apart, as in a sequential run)."""
    from hybrid_kv_plugin.cli.vllm_logs import route_vllm_logs

    route_vllm_logs()
    _warm_up(config)
    return _run_config(segments, settings, config, label, rows)


def _run_in_processes(segments: list[Any], settings: Any, configs: list[Any], labels: list[str], rows: bool,
                      jobs: int) -> tuple[list[Any], list[dict[str, Any]]]:
    """Each configuration in a fresh (spawned) process, up to ``jobs`` at once; results in
    ``configs`` order. Spawned, not forked: the parent has run torch, whose thread pools a fork
    does not carry over safely. A child's failure is raised here, with its traceback; it, an
    interrupt or SIGTERM stops the other children at once instead of waiting for their runs."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    pool = ProcessPoolExecutor(max_workers=min(jobs, len(configs)), mp_context=multiprocessing.get_context("spawn"))
    try:
        futures = [pool.submit(_child_run, segments, settings, c, label, rows) for c, label in zip(configs, labels)]
        done = [f.result() for f in futures]
    except BaseException:
        _stop_workers(pool)
        raise
    pool.shutdown()
    return [r for r, _ in done], [t for _, t in done]


def _stop_workers(pool: Any) -> None:
    """Terminate a process pool's workers and wait for them: ``shutdown`` alone lets each finish
    the configuration it is replaying (minutes) and, once it returns, forgets who they were."""
    import multiprocessing

    workers = multiprocessing.active_children()
    pool.shutdown(wait=False, cancel_futures=True)
    for worker in workers:
        worker.terminate()
    for worker in workers:
        worker.join(timeout=30)
        if worker.is_alive():
            worker.kill()
            worker.join()


def _wall() -> float:
    import time

    return time.monotonic()


def _warm_up(config: Any) -> None:
    """One three-token request on a small engine under ``config``: the imports and one-time set-up
    of vLLM's scheduler, managers, connector and the plugin's patches happen here, so no
    configuration's wall time carries them."""
    from hybrid_kv_plugin.sim.replay import ReplaySettings, replay
    from hybrid_kv_plugin.sim.workload import Segment, TraceRequest

    warm = Segment("warm-up", (TraceRequest("warm-up", 0, (1, 2, 3), 1),), eagle=False)
    replay([warm], ReplaySettings(gpu_blocks=64, cpu_blocks=64), config, observe=False, per_request=False)


def _timing(seconds: float, requests: int, steps: int, cpu_seconds: float) -> dict[str, Any]:
    """Wall and CPU time (user + system of this process, read twice a run: on a shared machine
    the CPU time is the figure that compares), throughput and peak RSS of one configuration's
    run (this process so far)."""
    import resource

    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "wall_s": round(seconds, 1),
        "cpu_s": round(cpu_seconds, 1),
        "requests_per_s": round(requests / seconds, 2) if seconds else None,
        "steps_per_s": round(steps / seconds, 1) if seconds else None,
        "peak_rss_mib": round(peak_kib / 1024),
    }
