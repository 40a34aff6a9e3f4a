"""``hybrid-kv``: ``doctor`` (what the plugin does on this vLLM) and, as features land, more."""

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

    replay = sub.add_parser("replay", help="replay a workload on the real vLLM scheduler: stock vs plugin")
    add_arguments(replay)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The command's own output is the report; vLLM's start-up chatter only hides it.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if args.command == "doctor":
        from hybrid_kv_plugin.cli.doctor import run_doctor

        serve_args = [a for a in args.serve_args if a != "--"] or None
        return run_doctor(json_output=args.json, serve_args=serve_args)
    if args.command == "replay":
        from hybrid_kv_plugin.cli.replay import run_replay_command

        return run_replay_command(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
