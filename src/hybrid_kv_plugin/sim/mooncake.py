"""Mooncake traces (the public FAST'25 release format) for ``hybrid-kv replay``.

One JSON object per line, exactly these keys: ``timestamp`` (arrival, ms), ``input_length``,
``output_length``, ``hash_ids`` (one id per ``block_tokens``-token block of the prompt, 512
in the public traces; equal ids mean equal content; the last block may be partial).

Tokens: each hash id stands for one fixed block of token ids, generated from the id alone
(the same id gives the same tokens in every run and process; two ids differ in their first
two tokens, so different ids never give equal blocks). A prompt is its blocks' tokens, cut
to ``input_length``, except where the conversation model (:mod:`hybrid_kv_plugin.sim.conversation`,
default ``continuation``) reads a request as the next turn of an earlier one.

Arrivals: request ``i`` arrives at scheduler step ``floor(timestamp / step_ms)`` (its
``wave``); the engine steps continuously, adding each request at its step, and when it has
no work it jumps to the next arrival. ``step_ms`` is the assumed duration of one scheduler
step (one forward pass); TTFT is reported in steps from arrival to the first token.
"""

from __future__ import annotations

import array
import json
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from hybrid_kv_plugin.sim.conversation import (
    DEFAULT_CONVERSATION_MODEL,
    TOKEN_TYPECODE,
    ConversationStats,
    PromptBuilder,
)
from hybrid_kv_plugin.sim.engine import SAMPLED_TOKEN
from hybrid_kv_plugin.sim.workload import Segment, TraceRequest

KEYS = frozenset({"timestamp", "input_length", "output_length", "hash_ids"})
DEFAULT_BLOCK_TOKENS = 512
DEFAULT_STEP_MS = 50.0
# Token ids are drawn from [2, VOCAB); ids 0/1 and SAMPLED_TOKEN's range stay free.
_VOCAB = 32000
_MAX_HASH_ID = (_VOCAB - 2) ** 2 - 1


class TraceFormatError(ValueError):
    """A trace line that cannot be replayed; the message names the line."""


def is_mooncake_line(item: Any) -> bool:
    """A Mooncake line carries ``hash_ids`` and ``input_length`` (the project's format never does)."""
    return isinstance(item, dict) and "hash_ids" in item and "input_length" in item


@dataclass(frozen=True)
class TimedRequest(TraceRequest):
    """A trace request with an arrival time; ``wave`` is its arrival step.

    ``prompt_token_ids`` is an ``array('H')`` (2 bytes a token: the full public conversation
    trace is 145 M prompt tokens), so :meth:`history` builds the tuple other code expects.
    """

    arrival_ms: float = 0.0

    def history(self) -> tuple[int, ...]:
        return tuple(self.prompt_token_ids) + (SAMPLED_TOKEN,) * self.max_tokens


@dataclass(frozen=True)
class TimedSegment(Segment):
    """Requests that arrive at their own steps (see the module docstring)."""

    step_ms: float = DEFAULT_STEP_MS
    conversation: ConversationStats | None = None  # how the prompts were read from the hash ids


class BlockTokens:
    """Token ids of each hash id's block (``array('H')``), a function of the id alone.

    The last ``keep`` blocks used are kept: the full conversation trace has 183 k distinct
    ids, each used 1.6 times on average, so keeping all (374 MB) bought little.
    """

    def __init__(self, block_tokens: int = DEFAULT_BLOCK_TOKENS, keep: int = 4096) -> None:
        self.block_tokens = block_tokens
        self.keep = keep
        self._cache: OrderedDict[int, array.array] = OrderedDict()

    def __call__(self, hash_id: int) -> array.array:
        block = self._cache.get(hash_id)
        if block is not None:
            self._cache.move_to_end(hash_id)
        else:
            import numpy as np

            rng = np.random.Generator(np.random.Philox(key=hash_id))
            values = rng.integers(2, _VOCAB, size=self.block_tokens, dtype=np.int32)
            # The id itself in the first two tokens: distinct ids give distinct blocks.
            values[0] = 2 + hash_id // (_VOCAB - 2)
            if self.block_tokens > 1:
                values[1] = 2 + hash_id % (_VOCAB - 2)
            block = array.array(TOKEN_TYPECODE, values.astype(np.uint16).tobytes())
            self._cache[hash_id] = block
            if len(self._cache) > self.keep:
                self._cache.popitem(last=False)
        return block


def _positive_int(item: dict, key: str, number: int, allow_zero: bool = False) -> int:
    value = item[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceFormatError(f"trace line {number}: {key} must be an integer, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise TraceFormatError(f"trace line {number}: {key} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return value


def parse_line(item: dict, number: int, block_tokens: int) -> tuple[float, int, int, list[int]]:
    """(timestamp, input_length, output_length, hash_ids) of one line, or a one-line error."""
    unknown = sorted(set(item) - KEYS)
    if unknown:
        raise TraceFormatError(
            f"trace line {number}: unknown key(s) {', '.join(map(repr, unknown))} for a Mooncake line "
            f"(allowed: {', '.join(sorted(KEYS))})"
        )
    missing = sorted(KEYS - set(item))
    if missing:
        raise TraceFormatError(f"trace line {number}: missing key(s) {', '.join(map(repr, missing))}")
    stamp = item["timestamp"]
    if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or stamp < 0:
        raise TraceFormatError(f"trace line {number}: timestamp must be a number of ms >= 0, got {stamp!r}")
    input_length = _positive_int(item, "input_length", number)
    output_length = _positive_int(item, "output_length", number)
    hash_ids = item["hash_ids"]
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and 0 <= h <= _MAX_HASH_ID for h in hash_ids
    ):
        raise TraceFormatError(f"trace line {number}: hash_ids must be a list of integers in [0, {_MAX_HASH_ID}]")
    blocks = -(-input_length // block_tokens)
    if len(hash_ids) != blocks:
        raise TraceFormatError(
            f"trace line {number}: input_length {input_length} needs {blocks} hash id(s) of "
            f"{block_tokens} tokens, the line has {len(hash_ids)} (see --trace-block-tokens)"
        )
    return float(stamp), input_length, output_length, hash_ids


def load_mooncake(
    lines: Iterable[str],
    *,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    step_ms: float = DEFAULT_STEP_MS,
    limit: int | None = None,
    first_line: tuple[int, dict] | None = None,
    conversation_model: str = DEFAULT_CONVERSATION_MODEL,
) -> list[Segment]:
    """One :class:`TimedSegment` named ``mooncake``, requests in file order (ids ``mc<N>``).

    ``first_line``: a line the caller already parsed (its number and object).
    ``conversation_model``: ``continuation`` or ``blocks`` (:mod:`hybrid_kv_plugin.sim.conversation`).
    """
    prompts = PromptBuilder(BlockTokens(block_tokens), block_tokens, conversation_model)
    requests: list[TimedRequest] = []
    previous_stamp = 0.0

    def add(number: int, item: Any) -> None:
        nonlocal previous_stamp
        if not is_mooncake_line(item):
            raise TraceFormatError(
                f"trace line {number}: not a Mooncake line (the file mixes formats: its first line is Mooncake)"
            )
        stamp, input_length, output_length, hash_ids = parse_line(item, number, block_tokens)
        if stamp < previous_stamp:
            raise TraceFormatError(f"trace line {number}: timestamp {stamp:g} is earlier than the line before")
        previous_stamp = stamp
        requests.append(
            TimedRequest(
                request_id=f"mc{len(requests)}",
                wave=int(stamp // step_ms),
                prompt_token_ids=prompts.add(hash_ids, input_length, output_length),  # type: ignore[arg-type]
                max_tokens=output_length,
                arrival_ms=stamp,
            )
        )

    if first_line is not None:
        add(*first_line)
    for number, line in lines_of(lines, start=(first_line[0] + 1) if first_line else 1):
        if limit is not None and len(requests) >= limit:
            break
        add(number, line)
    if not requests:
        return []
    return [TimedSegment("mooncake", tuple(requests), step_ms=step_ms, conversation=prompts.stats)]


def lines_of(lines: Iterable[str], start: int = 1) -> Iterable[tuple[int, Any]]:
    """(line number, parsed object) of every non-blank line; a JSON error names its line."""
    for number, line in enumerate(lines, start=start):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"trace line {number}: not JSON ({exc.msg})") from None


# ---------------------------------------------------------------------------- timed driving
def run_timed(
    engine: Any,
    segment: TimedSegment,
    progress: Callable[[int], None] | None,
    done: int,
) -> tuple[int, dict[str, int]]:
    """Step ``engine`` continuously, adding each request at its arrival step.

    Returns (requests done, all segments; TTFT in steps per request id: from the arrival
    step to the step that sampled its first token).
    """
    queue = sorted(segment.requests, key=lambda r: r.wave)
    arrival: dict[str, int] = {}
    ttft: dict[str, int] = {}
    scheduler = engine.scheduler
    clock = 0
    next_index = 0
    finished_before = done
    while next_index < len(queue) or engine.has_work():
        if not engine.has_work() and next_index < len(queue):
            clock = max(clock, queue[next_index].wave)  # idle: jump to the next arrival
        while next_index < len(queue) and queue[next_index].wave <= clock:
            request = queue[next_index]
            engine.add_request(request.request_id, request.prompt_token_ids, max_tokens=request.max_tokens)
            arrival[request.request_id] = clock
            next_index += 1
        record = engine.step()
        for rid in record.num_scheduled_tokens:
            if rid not in ttft:
                live = scheduler.requests.get(rid)
                if live is None or live.num_output_tokens > 0:
                    ttft[rid] = clock - arrival[rid]
        for rid in record.finished:
            if rid not in ttft and rid in arrival:
                ttft[rid] = clock - arrival[rid]
        clock += 1
        if record.finished:
            done += len(record.finished)
            if progress:
                progress(done)
    if progress and done == finished_before:
        progress(done)
    return done, ttft
