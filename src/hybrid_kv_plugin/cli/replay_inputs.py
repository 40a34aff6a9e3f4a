"""What ``hybrid-kv replay`` (one engine, or ``--engines N``) reads before anything runs: the
trace (either format) or the embedded workload, the model geometry (``--model DIR`` or a serve
line after ``--``), and their checks: the serve line as ``doctor`` checks it, the requests vLLM
would refuse, pools cut to what the trace can take, and the next step when the prefix-match
unit leaves the plugin nothing to do.

Every bad input ends as ``SystemExit("hybrid-kv: ...")`` (one line, exit 2 via
:func:`~hybrid_kv_plugin.cli.errors.fail`); the checks that need no vLLM run before vLLM is imported.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from hybrid_kv_plugin.cli.args import SETTINGS_FLAGS, given_geometry
from hybrid_kv_plugin.cli.errors import fail
from hybrid_kv_plugin.models.geometry import DEFAULT_CPU_GIB, DEFAULT_GPU_KV_GIB, GIB


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
        "--conversation-model", choices=("continuation", "blocks"), default=None,
        help="Mooncake traces: continuation (default) reads a request that extends all full blocks of an "
        "earlier one ending in a partial block as that chat's next turn (earlier prompt + its answer + new "
        "tokens); blocks gives every hash id its own tokens, so chats diverge at a block boundary",
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
    mooncake_only = (args.trace_block_tokens, args.step_ms, args.conversation_model)
    if (args.limit is not None or any(v is not None for v in mooncake_only)) and not args.trace:
        fail("--limit, --trace-block-tokens, --step-ms and --conversation-model apply to --trace")


def serve_line(args: argparse.Namespace) -> list[str]:
    return [a for a in (getattr(args, "serve_args", None) or []) if a != "--"]


def load_trace_file(args: argparse.Namespace) -> list[Any]:
    """The segments of ``--trace``, its format told by its first line's keys."""
    from hybrid_kv_plugin.sim.mooncake import (
        DEFAULT_BLOCK_TOKENS,
        DEFAULT_CONVERSATION_MODEL,
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
                    conversation_model=args.conversation_model or DEFAULT_CONVERSATION_MODEL,
                )
            if any(v is not None for v in (args.trace_block_tokens, args.step_ms, args.conversation_model)):
                fail(
                    "--trace-block-tokens, --step-ms and --conversation-model apply to Mooncake traces; "
                    "this one is in the project's format"
                )
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
    from hybrid_kv_plugin.models.geometry import GeometryError, ServeLine, parse_serve_line, resolve

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


# The shipped tiny model's max_position_embeddings: the ceiling without a model.
DEFAULT_MAX_MODEL_LEN = 262144
# Why vLLM's server answers a request with an error instead of serving it (the report's keys).
REFUSALS = ("prompt_too_long", "prompt_plus_output_too_long")


def refuse_too_long(segments: Sequence[Any], max_model_len: int, strict: bool = False) -> tuple[list[Any], dict[str, int]]:
    """The segments without the requests vLLM would refuse, and how many per reason.

    vLLM's rule: a prompt must leave room for its first output token, and prompt + the output
    the trace asks for must fit the model. ``strict``: the first such request stops the replay.
    """
    from dataclasses import replace

    refused = {reason: 0 for reason in REFUSALS}
    kept_segments = []
    for segment in segments:
        kept = []
        for request in segment.requests:
            prompt = len(request.prompt_token_ids)
            if prompt >= max_model_len:
                reason = "prompt_too_long"
                message = f"prompt of {prompt} tokens does not fit the model's max model length {max_model_len}"
            elif prompt + request.max_tokens > max_model_len:
                reason = "prompt_plus_output_too_long"
                message = (
                    f"prompt of {prompt} tokens + {request.max_tokens} output tokens exceed the model's max model "
                    f"length {max_model_len}"
                )
            else:
                kept.append(request)
                continue
            if strict:
                fail(f"request {request.request_id}: {message} (without --strict it is counted as refused)")
            refused[reason] += 1
        if kept:
            kept_segments.append(replace(segment, requests=tuple(kept)))
    counts = {reason: n for reason, n in refused.items() if n}
    if not kept_segments:
        fail(f"every request is refused by vLLM ({'; '.join(f'{k}: {n}' for k, n in counts.items())}): nothing to replay")
    return kept_segments, counts


def check_serve_line(args: argparse.Namespace) -> None:
    """The serve line after ``--`` as vLLM and the plugin would check it at start-up (the checks
    and messages of ``hybrid-kv doctor``): an invalid one stops the replay in one line."""
    line = serve_line(args)
    if not line:
        return
    from hybrid_kv_plugin.cli.serve_args import check_serve_args
    from hybrid_kv_plugin.registration import current_adapter

    errors = check_serve_args(line, current_adapter()).errors
    if errors:
        fail(f"invalid vllm serve line: {'; '.join(errors)}")


def cap_pools(settings: Any, model: Any, segments: Sequence[Any]) -> tuple[Any, list[str]]:
    """The resolved pools cut to what the trace can take (the same result, see
    :mod:`hybrid_kv_plugin.sim.pool_bound`), and a note per pool cut; a pool past
    ``ABSURD_BLOCKS`` gets a warning (a toy geometry at a server's memory)."""
    from dataclasses import replace

    from hybrid_kv_plugin.sim.pool_bound import ABSURD_BLOCKS, blocks_a_workload_can_take

    bound = blocks_a_workload_can_take(
        segments,
        attention_block_size=settings.attention_block_size,
        mamba_block_size=settings.mamba_block_size,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        num_speculative_tokens=settings.num_speculative_tokens,
        mamba_groups=settings.mamba_groups,
    )
    notes = []
    changes = {}
    for field, name, gib in (("gpu_blocks", "GPU", model.gpu_kv_bytes / GIB), ("cpu_blocks", "CPU", model.cpu_bytes / GIB)):
        resolved = getattr(settings, field)
        if resolved <= bound:
            continue
        changes[field] = bound
        note = (
            f"{name} pool of {resolved} blocks ({gib:g} GiB) replayed as {bound}, all this trace can take "
            "(no block is evicted either way: the result is the same)"
        )
        if resolved > ABSURD_BLOCKS:
            note = (
                f"warning: this geometry makes {resolved} {name} blocks of {model.block_bytes} bytes at {gib:g} GiB "
                f"(a toy model at a server's memory?); replayed as {bound}, all this trace can take, with the same "
                f"result; {'--gpu-kv-gib' if field == 'gpu_blocks' else '--cpu-gib'} sets the memory"
            )
        notes.append(note)
    return replace(settings, **changes), notes


def next_steps(settings: Any, model: Any, args: argparse.Namespace) -> list[str]:
    """What an operator can do next; today: a finer unit where the unit equals the Mamba block
    (named as ``doctor`` names it: :func:`hybrid_kv_plugin.models.unit_advice.finer_unit`)."""
    unit, block = settings.hash_block_size, settings.mamba_block_size
    if unit < block or settings.mamba_cache_mode != "align":
        return []
    advice = _finer_unit(model, args) if model is not None else None
    how = (
        f"{advice.describe()}; put it in the serve line after --"
        if advice is not None
        else "a finer --prefix-match-unit (one that divides both blocks; `hybrid-kv doctor -- DIR` names the finest "
        "vLLM accepts) makes hits inside a block possible"
    )
    return [
        f"the prefix-match unit equals the Mamba block ({block} tokens): every hit is whole Mamba blocks, where "
        f"stock vLLM already keeps every state, so the plugin cannot add anything; {how}"
    ]


# The share of the ideal the CPU tier must have evicted (in the configuration that lost most that
# way) before the report points at ``--tier-ceiling``.
EVICTION_HINT_SHARE = 0.10


def tier_size_hint(results: Sequence[dict]) -> str | None:
    """A next step when the CPU tier's evictions cost a configuration a tenth of its ideal or more."""
    lost = [(r["loss"]["evicted"] / r["ideal_tokens"], r["name"]) for r in results if r.get("ideal_tokens") and "loss" in r]
    if not lost:
        return None
    share, name = max(lost)
    if share < EVICTION_HINT_SHARE:
        return None
    return (
        f"CPU-tier evictions cost {name} {share:.1%} of the ideal: --tier-ceiling shows what a tier of this size can "
        "keep of this workload and the tier that keeps 0.90 / 0.95 of it (--cpu-gib or cpu_bytes_to_use sets the size)"
    )


def _finer_unit(model: Any, args: argparse.Namespace) -> Any:
    from hybrid_kv_plugin.models.geometry import GeometryError, ServeLine, parse_serve_line
    from hybrid_kv_plugin.models.unit_advice import finer_unit

    line = serve_line(args)
    try:
        return finer_unit(parse_serve_line(line) if line else ServeLine(model=args.model), model)
    except GeometryError:
        return None


def load_segments(args: argparse.Namespace) -> list[Any]:
    from hybrid_kv_plugin.sim.workload import default_workload, with_eagle

    if args.trace:
        segments = load_trace_file(args)
    else:
        if args.scale < 1:
            fail("--scale must be >= 1")
        segments = default_workload(seed=args.seed, scale=args.scale)
    segments = with_eagle(segments, args.eagle)
    if getattr(args, "cold_replay", False):
        from hybrid_kv_plugin.sim.cold_replay import cold_replay_segments

        segments = cold_replay_segments(segments)
    return segments


def prepare_inputs(args: argparse.Namespace, settings: Any, segments: list[Any]) -> tuple[Any, Any, list[Any], dict[str, int], list[str]]:
    """The serve line checked as start-up checks it, the model resolved, the requests vLLM would
    refuse left out and the pools capped: (model, settings, segments, refused, pool notes).
    Bad input raises ``SystemExit`` with the one-line message (:func:`~hybrid_kv_plugin.cli.errors.fail`)."""
    check_serve_line(args)
    model = resolve_model(args)
    if model is not None:
        settings = settings_for_model(settings, model, args)
    segments, refused = refuse_too_long(segments, settings.max_model_len or DEFAULT_MAX_MODEL_LEN, strict=args.strict)
    pool_notes: list[str] = []
    if model is not None:
        settings, pool_notes = cap_pools(settings, model, segments)
    return model, settings, segments, refused, pool_notes


def add_input_notes(report: dict, refused: dict[str, int], pool_notes: list[str], model: Any) -> None:
    """What ``prepare_inputs`` found, in the report: requests left out, pool caps, the resolved model."""
    if refused:
        report["refused_requests"] = refused
    if pool_notes:
        report["pool_notes"] = pool_notes
    if model is not None:
        report["model_geometry"] = model.as_dict()


def settings_for_model(settings: Any, model: Any, args: argparse.Namespace) -> Any:
    """The replay settings of a resolved model: its block sizes, unit, length and pools.

    Explicit geometry flags would contradict the model, so they are refused.
    """
    from dataclasses import replace

    flags = given_geometry(args)
    given = [SETTINGS_FLAGS[n] for n in MODEL_GEOMETRY_FIELDS if n in flags]
    if given:
        fail(f"{', '.join(given)} conflict(s) with the model's resolved geometry; put cache flags in the serve line after --")
    return replace(
        settings,
        attention_block_size=model.attention_block_size,
        mamba_block_size=model.mamba_block_size,
        hash_block_size=model.hash_block_size,
        mamba_cache_mode=model.mamba_cache_mode,
        gpu_blocks=model.gpu_blocks,
        cpu_blocks=model.cpu_blocks,
        max_model_len=model.max_model_len,
        max_num_batched_tokens=model.max_num_batched_tokens,
        max_num_seqs=model.max_num_seqs,
        mamba_groups=model.mamba_groups,
    )


# The settings a resolved model decides; a flag that sets one of them contradicts the model.
MODEL_GEOMETRY_FIELDS = ("attention_block_size", "mamba_block_size", "hash_block_size", "gpu_blocks", "cpu_blocks")
