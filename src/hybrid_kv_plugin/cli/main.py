"""The ``hybrid-kv`` command: parser, exit-code rule and log routing shared by every subcommand."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import textwrap
import threading
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

from hybrid_kv_plugin.cli.vllm_logs import route_vllm_logs

DESCRIPTION = """\
hybrid-kv: check and measure the hybrid-kv vLLM plugin on this machine's vLLM.

  doctor   what the plugin does on this vLLM: adapter, per-feature native/backport/unavailable,
           the patches it installs, bad HYBRID_KV_* variables; validates a `vllm serve` line after --
  replay   what a workload reuses on this wheel's real scheduler, stock vs plugin (CPU, no weights)
  bench    scheduler CPU time per step, plugin vs stock
"""

EXIT_CODES = """\
exit codes (every subcommand):
  0  success (doctor: the plugin is active, or disabled on purpose)
  2  invalid input or configuration: a bad flag or value, an unreadable file, an invalid
     `vllm serve` line, a malformed HYBRID_KV_* environment variable
  1  failure: the plugin cannot work here (doctor: vLLM outside 0.26-0.33, not installed, or
     changed internals) or an internal error
  130, 143  interrupted (Ctrl-C) or terminated (SIGTERM): child processes stopped, temp files removed

vLLM's own log lines go to stderr; stdout carries only the report (--json is pure JSON).
"""

EXIT_OK, EXIT_FAILURE, EXIT_INVALID = 0, 1, 2


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Plain description text as written, and each option's default when it has a real one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "%(default)" not in text
            and action.option_strings
            and default is not None
            and default is not False
            and default is not argparse.SUPPRESS
            and action.nargs != 0
        ):
            text += " (default: %(default)s)"
        return text


def version_line() -> str:
    """Plugin version, the installed vLLM and the adapter the plugin would use (no vLLM import
    unless the version string carries no release number)."""
    from hybrid_kv_plugin import __version__
    from hybrid_kv_plugin.adapters import select_adapter

    selection = select_adapter()
    if selection.adapter is not None:
        return f"hybrid-kv-plugin {__version__} on vLLM {selection.installed.raw} ({selection.adapter.name})"
    return f"hybrid-kv-plugin {__version__} (inert here: {selection.reason})"


class _VersionAction(argparse.Action):
    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit(EXIT_OK)


def build_parser() -> argparse.ArgumentParser:
    """Every parser is a :class:`~hybrid_kv_plugin.cli.args.OneLineParser` (subparsers take the
    parent's class): no abbreviations, a bad argument is one line on stderr and exit 2."""
    from hybrid_kv_plugin.cli.args import OneLineParser

    parser = OneLineParser(
        prog="hybrid-kv", description=DESCRIPTION, epilog=EXIT_CODES, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--version", action=_VersionAction, help="plugin version, the installed vLLM and the adapter, then exit"
    )
    sub = parser.add_subparsers(dest="command", metavar="{doctor,replay,bench}")

    def add(name: str, help: str, description: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name, help=help, description=textwrap.fill(description, 100), epilog=EXIT_CODES, formatter_class=HelpFormatter
        )

    doctor = add(
        "doctor",
        "vLLM version, adapter, and per-feature native/backport/unavailable",
        "What the plugin does in a vLLM process on this machine: the vLLM version and adapter, each "
        "feature's support (native / backport / unavailable), the patches register() installs, and any "
        "malformed HYBRID_KV_* environment variable. After --, a `vllm serve` argument list to validate.",
    )
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument(
        "serve_args", nargs=argparse.REMAINDER, help="after --: a vllm serve command line to validate"
    )
    from hybrid_kv_plugin.cli.replay import add_arguments

    replay = add(
        "replay",
        "replay a workload on the real vLLM scheduler: stock vs plugin",
        "Drive this wheel's real Scheduler, KVCacheManager and SimpleCPU connector in-process "
        "(no GPU, no weights) over a workload, once per configuration, and report per configuration the "
        "ideal reusable tokens, the tokens reused from the GPU prefix cache and from the CPU tier, "
        "efficiency = reused / ideal, scheduler steps, and why every lost token was lost.",
    )
    add_arguments(replay)
    from hybrid_kv_plugin.cli import bench as bench_cli

    bench = add(
        "bench",
        "scheduler CPU time per step, plugin vs stock, and reuse efficiency",
        "Process CPU time of scheduler.schedule() + update_from_output() per step, plugin vs "
        "stock in one process, repeats interleaved (ABBA); reports the plugin/stock ratio as min/median/max "
        "on the default workload and on a large one (--requests).",
    )
    bench_cli.add_arguments(bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; returns its exit code. Bad input inside a command raises
    ``SystemExit("hybrid-kv: ...")``, which :func:`console_main` turns into one line and exit 2."""
    route_vllm_logs()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # `hybrid-kv` alone: the help is the answer
        parser.print_help()
        return EXIT_OK
    if args.command == "doctor":
        from hybrid_kv_plugin.cli.doctor import run_doctor

        serve_args = [a for a in args.serve_args if a != "--"] or None
        return run_doctor(json_output=args.json, serve_args=serve_args)
    if args.command == "replay":
        from hybrid_kv_plugin.cli.replay import run_replay_command

        return run_replay_command(args)
    from hybrid_kv_plugin.cli.bench import run_bench_command

    return run_bench_command(args)


def console_main(argv: Sequence[str] | None = None) -> int:
    """The console script: applies the exit-code rule of :data:`EXIT_CODES` to every subcommand."""
    from hybrid_kv_plugin.config import PluginConfigError
    from hybrid_kv_plugin.models.environment import private_temp_root

    try:
        # The handler outermost: a second SIGTERM while the temp root is removed is ignored too.
        with _sigterm_exits(), private_temp_root():
            return main(argv)
    except SystemExit as stop:
        if isinstance(stop.code, str):  # a command's one-line refusal of bad input
            print(stop.code, file=sys.stderr)
            return EXIT_INVALID
        return EXIT_OK if stop.code is None else int(stop.code)
    except PluginConfigError as err:
        print(f"hybrid-kv: {err}", file=sys.stderr)
        return EXIT_INVALID
    except KeyboardInterrupt:
        print("hybrid-kv: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - a bug, not bad input: keep the traceback for the report
        traceback.print_exc()
        print(
            f"hybrid-kv: internal error: {type(err).__name__}: {err} "
            "(please report it with the output of `hybrid-kv --version`)",
            file=sys.stderr,
        )
        return EXIT_FAILURE


EXIT_TERMINATED = 128 + signal.SIGTERM


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """SIGTERM (``kill``, a job's time limit) ends the command as Ctrl-C does: through the
    ``finally`` blocks that stop child processes and remove the temp root, which the default
    action (die at once) would skip. Only the first SIGTERM counts: later ones (``timeout``
    passing on a ``kill`` sent to both) are ignored until the process ends, also by an
    in-process caller, which is being terminated. Only the main thread may set a handler."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stopping = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        if stopping:
            return  # already on the way out
        stopping = True
        print("hybrid-kv: terminated", file=sys.stderr)
        raise SystemExit(EXIT_TERMINATED)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        # Once terminated the process is on its way out (interpreter shutdown takes a while with
        # vLLM loaded): a later SIGTERM must not turn exit 143 into death by signal.
        signal.signal(signal.SIGTERM, signal.SIG_IGN if stopping else previous)


if __name__ == "__main__":
    sys.exit(console_main())
