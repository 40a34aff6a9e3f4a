"""``hybrid-kv``: ``doctor`` (what the plugin does on this vLLM), ``replay`` (what a workload reuses,
stock vs plugin, on the real scheduler) and ``bench`` (scheduler CPU overhead of the plugin)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybrid-kv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="vLLM version, adapter, and per-feature native/backport/unavailable")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument(
        "serve_args", nargs=argparse.REMAINDER, help="after --: a vllm serve command line to validate"
    )
    from hybrid_kv_plugin.cli.replay import add_arguments

    replay = sub.add_parser(
        "replay",
        help="replay a workload on the real vLLM scheduler: stock vs plugin",
        description="Drive this wheel's real Scheduler, KVCacheManager and SimpleCPU connector in-process "
        "(no GPU, no weights) over a workload, once per configuration, and report per configuration the "
        "ideal reusable tokens, the tokens reused from the GPU prefix cache and from the CPU tier, "
        "efficiency = reused / ideal, scheduler steps, and why every lost token was lost.",
    )
    add_arguments(replay)
    from hybrid_kv_plugin.cli import bench as bench_cli

    bench = sub.add_parser(
        "bench",
        help="scheduler CPU time per step, plugin vs stock, and reuse efficiency",
        description="Process CPU time of scheduler.schedule() + update_from_output() per step, plugin vs "
        "stock in one process, repeats interleaved (ABBA); reports the plugin/stock ratio as min/median/max "
        "on the default workload and on a large one (--requests).",
    )
    bench_cli.add_arguments(bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _run(argv)
    except SystemExit as exc:
        # A bad input is one line on stderr and exit 2 (argparse's own code), never a traceback.
        if isinstance(exc.code, str):
            sys.stderr.write(exc.code.rstrip("\n") + "\n")
            return 2
        raise


def _run(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    # The command's own output is the report; vLLM's start-up chatter only hides it.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # vLLM logs to stdout by default; stdout is the report (``--json`` is parsed by scripts).
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if args.command == "doctor":
        from hybrid_kv_plugin.cli.doctor import run_doctor

        serve_args = [a for a in args.serve_args if a != "--"] or None
        return run_doctor(json_output=args.json, serve_args=serve_args)
    if args.command == "replay":
        from hybrid_kv_plugin.cli.replay import run_replay_command

        return run_replay_command(args)
    if args.command == "bench":
        from hybrid_kv_plugin.cli.bench import run_bench_command

        return run_bench_command(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
