"""``hybrid-kv bench``: scheduler CPU time per step, plugin vs stock, and reuse efficiency."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import TextIO

from hybrid_kv_plugin.cli.errors import fail


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from hybrid_kv_plugin.cli.args import CONFIG_NAMES, add_geometry_arguments

    parser.add_argument("--repeats", type=int, default=5, help="runs per configuration (ABBA-interleaved)")
    parser.add_argument("--requests", type=int, default=2000, help="size of the large case (0: default case only)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the embedded workload")
    parser.add_argument(
        "--configs",
        default="stock,plugin,plugin+divergence",
        help=f"comma-separated, from {', '.join(CONFIG_NAMES)} (as in replay); the first is the baseline "
        "of the ratios (default: stock,plugin,plugin+divergence)",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="time every configuration in this one interpreter (default: one process per configuration, "
        "as a server runs one engine)",
    )
    parser.add_argument(
        "--bytecodes",
        action="store_true",
        help="also count the Python bytecode instructions per step (one more, untimed run per "
        "configuration; deterministic, unlike CPU time on a shared machine)",
    )
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="drive vLLM's AsyncScheduler, as a GPU `vllm serve` does by default (default: Scheduler)",
    )
    add_geometry_arguments(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run_bench_command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from hybrid_kv_plugin.cli.args import choose_configs, settings_from
    from hybrid_kv_plugin.cli.progress import Progress
    from hybrid_kv_plugin.sim.bench import BenchCase, run_bench
    from hybrid_kv_plugin.sim.workload import default_workload, with_eagle, workload_of_size

    out = out or sys.stdout
    if args.repeats < 1 or args.requests < 0:
        fail("--repeats must be >= 1 and --requests >= 0")
    configs = choose_configs(args.configs, ())
    if len({c.name for c in configs}) != len(configs):
        fail(f"--configs {args.configs!r}: each configuration at most once")
    settings = dataclasses.replace(settings_from(args), async_scheduling=args.async_scheduling)
    cases = [BenchCase("default", tuple(with_eagle(default_workload(args.seed), args.eagle)))]
    if args.requests:
        large = tuple(with_eagle(workload_of_size(args.requests, args.seed), args.eagle))
        cases.append(BenchCase(f"{sum(len(s.requests) for s in large)} requests", large))
    total = sum(c.requests for c in cases) * (args.repeats + (1 if args.bytecodes else 0)) * len(configs)
    progress = Progress(total)

    def advance(label: str, requests: int) -> None:
        progress.start(label)
        progress.finish_run(requests)
        progress.update(0)

    report = run_bench(
        cases,
        settings,
        repeats=args.repeats,
        progress=advance,
        configs=configs,
        bytecodes=args.bytecodes,
        processes=not args.in_process,
    )
    progress.close()
    if args.json:
        out.write(json.dumps(report, indent=2) + "\n")
    else:
        render_bench(report, out)
    return 0


def render_bench(report: dict, out: TextIO) -> None:
    w = out.write
    w(
        f"hybrid-kv bench on vLLM {report['vllm']}: {report['timed']}, {report['repeats']} repeats per "
        f"configuration, processes: {report['processes']}, vLLM's {report['scheduler']}\n"
    )
    for case in report["cases"]:
        w(f"\n{case['name']} ({case['requests']} requests)\n")
        width = max(10, *(len(name) for name in case["configs"]))
        counted = any("bytecodes_per_step" in entry for entry in case["configs"].values())
        w(
            f"  {'config':<{width}} {'steps':>7} {'efficiency':>10} {'CPU us/step min':>16} {'median':>8} {'max':>8} "
            f"{'floor':>8}" + (f" {'bytecodes/step':>14}" if counted else "") + "\n"
        )
        for name, entry in case["configs"].items():
            if "refused" in entry:
                w(f"  {name:<{width}} refused: {entry['refused']}\n")
                continue
            t = entry.get("step_cpu_us", {})
            w(
                f"  {name:<{width}} {entry['steps']:>7} {entry['efficiency']:>10.3f} "
                f"{t.get('min', 0):>16.1f} {t.get('median', 0):>8.1f} {t.get('max', 0):>8.1f} "
                f"{entry.get('step_floor_us', 0):>8.1f}"
                + (f" {entry['bytecodes_per_step']:>14.1f}" if "bytecodes_per_step" in entry else "")
                + "\n"
            )
        for key, ratio in case.items():
            if key.startswith("ratio_"):
                label = key[len("ratio_") :].replace("_vs_", " / ")
                w(
                    f"  ratio {label}: per-step floor {case['floor_' + key]:.4f}; per repeat median "
                    f"{ratio['median']:.4f} (min {ratio['min']:.4f}, max {ratio['max']:.4f}; "
                    f"{', '.join(f'{r:.3f}' for r in ratio['per_repeat'])})\n"
                )
                if "bytecode_" + key in case:
                    w(f"  ratio {label}: bytecodes per step {case['bytecode_' + key]:.4f} (deterministic)\n")
