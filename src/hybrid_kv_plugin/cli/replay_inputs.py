"""What ``hybrid-kv replay`` reads before anything runs: the trace (either format), the
model geometry (``--model DIR`` or a serve line after ``--``), and their checks.

Every bad input ends as ``SystemExit("hybrid-kv: ...")`` (one line, exit 2 via
:func:`fail`); the checks that need no vLLM run before vLLM is imported.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any, NoReturn

from hybrid_kv_plugin.sim.model_geometry import DEFAULT_CPU_GIB, DEFAULT_GPU_KV_GIB, GIB


class InputError(Exception):
    """A bad input: the message is the whole (one-line) answer."""


def fail(message: str) -> NoReturn:
    raise InputError(f"hybrid-kv: {message}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("trace and model")
    g.add_argument("--limit", type=int, metavar="N", help="replay only the first N requests of --trace")
    g.add_argument(
        "--trace-block-tokens", type=int, default=None, metavar="N",
        help="Mooncake traces: tokens per hash id (default 512, the public traces' block)",
    )
    g.add_argument(
        "--step-ms", type=float, default=None, metavar="MS",
        help="Mooncake traces: assumed duration of one scheduler step; a request arrives at step "
        "timestamp / MS (default 50)",
    )
    g.add_argument(
        "--model", metavar="DIR",
        help="a local model directory with a config.json (no weights): geometry, max model length and "
        "pools resolved by vLLM's own config code; the same as `-- DIR` (a vllm serve line)",
    )
    g.add_argument("--gpu-kv-gib", type=float, default=None, metavar="GIB",
                   help=f"with a model: GPU memory for the KV cache (default {DEFAULT_GPU_KV_GIB:g}; "
                   "a serve line's --kv-cache-memory-bytes wins)")
    g.add_argument("--cpu-gib", type=float, default=None, metavar="GIB",
                   help=f"with a model: CPU-tier size (default {DEFAULT_CPU_GIB:g}; a serve line's "
                   "cpu_bytes_to_use wins)")
    parser.add_argument(
        "serve_args", nargs=argparse.REMAINDER,
        help="after --: a vllm serve command line (model directory and cache flags) to resolve the geometry from",
    )


def check_flags(args: argparse.Namespace) -> None:
    """Flag combinations, before any file is read."""
    if args.per_request and not args.json:
        fail("--per-request needs --json (it adds every request's detail to the JSON report)")
    if args.limit is not None and args.limit < 1:
        fail(f"--limit must be >= 1, got {args.limit}")
    if args.trace_block_tokens is not None and args.trace_block_tokens < 1:
        fail(f"--trace-block-tokens must be >= 1, got {args.trace_block_tokens}")
    if args.step_ms is not None and not args.step_ms > 0:
        fail(f"--step-ms must be > 0, got {args.step_ms}")
    for name in ("gpu_kv_gib", "cpu_gib"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            fail(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if args.model and serve_line(args):
        fail("give the model either as --model DIR or in the serve line after --, not both")
    if (args.limit is not None or args.trace_block_tokens is not None or args.step_ms is not None) and not args.trace:
        fail("--limit, --trace-block-tokens and --step-ms apply to --trace")


def serve_line(args: argparse.Namespace) -> list[str]:
    return [a for a in (getattr(args, "serve_args", None) or []) if a != "--"]


def load_trace_file(args: argparse.Namespace) -> list[Any]:
    """The segments of ``--trace``, its format told by its first line's keys."""
    from hybrid_kv_plugin.sim.mooncake import (
        DEFAULT_BLOCK_TOKENS,
        DEFAULT_STEP_MS,
        TraceFormatError,
        is_mooncake_line,
        lines_of,
        load_mooncake,
    )
    from hybrid_kv_plugin.sim.workload import load_trace

    path = args.trace
    try:
        with open(path, encoding="utf-8") as handle:
            first = None
            for number, item in lines_of(handle):
                first = (number, item)
                break
            if first is None:
                fail(f"--trace {path} holds no request")
            if is_mooncake_line(first[1]):
                return load_mooncake(
                    handle,
                    block_tokens=args.trace_block_tokens or DEFAULT_BLOCK_TOKENS,
                    step_ms=args.step_ms or DEFAULT_STEP_MS,
                    limit=args.limit,
                    first_line=first,
                )
            if args.trace_block_tokens is not None or args.step_ms is not None:
                fail("--trace-block-tokens and --step-ms apply to Mooncake traces; this one is in the project's format")
            handle.seek(0)
            lines = list(handle)
    except OSError as exc:
        fail(f"cannot read --trace {path}: {exc.strerror}")
    except TraceFormatError as exc:
        fail(f"--trace {path}: {exc}")
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                if is_mooncake_line(json.loads(line)):
                    fail(f"--trace {path}: trace line {number}: a Mooncake line in a trace in the project's format "
                         "(the file mixes formats)")
            except ValueError:
                pass  # load_trace names the line
    if args.limit is not None:
        lines = _first_requests(lines, args.limit)
    try:
        segments = load_trace(lines)
    except ValueError as exc:
        fail(f"--trace {path}: {exc}")
    if not segments:
        fail(f"--trace {path} holds no request")
    return segments


def _first_requests(lines: list[str], limit: int) -> list[str]:
    out, count = [], 0
    for line in lines:
        if count >= limit:
            break
        out.append(line)
        count += bool(line.strip())
    return out


def resolve_model(args: argparse.Namespace) -> Any:
    """The :class:`ModelGeometry` of ``--model`` / the serve line, or None when neither is given."""
    from hybrid_kv_plugin.sim.model_geometry import GeometryError, ServeLine, parse_serve_line, resolve

    line = serve_line(args)
    if not args.model and not line:
        return None
    try:
        serve = parse_serve_line(line) if line else ServeLine(model=args.model)
        return resolve(
            serve,
            gpu_kv_bytes=int(args.gpu_kv_gib * GIB) if args.gpu_kv_gib else None,
            cpu_bytes=int(args.cpu_gib * GIB) if args.cpu_gib else None,
        )
    except GeometryError as exc:
        fail(str(exc))


def check_lengths(segments: Sequence[Any], max_model_len: int) -> None:
    """A prompt must leave room for at least its first output token (vLLM's own rule)."""
    for segment in segments:
        for request in segment.requests:
            prompt = len(request.prompt_token_ids)
            if prompt >= max_model_len:
                fail(
                    f"request {request.request_id}: prompt of {prompt} tokens does not fit the model's "
                    f"max model length {max_model_len}"
                )
