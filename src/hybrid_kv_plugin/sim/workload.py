"""Workloads for ``hybrid-kv replay`` / ``bench``: the embedded default, JSONL traces, the ideal reuse.

A workload is a list of :class:`Segment`. Each segment runs on its own fresh engine
(GPU prefix cache and CPU tier start empty) with its own speculative setting, so an
EAGLE part and a plain part can share one report. Inside a segment, requests are
grouped in *waves*: a wave's requests arrive together and run to completion before
the next wave; ``evict_gpu_before`` empties the GPU prefix cache first (what GPU-cache
pressure does in a long-running server), so only the CPU tier can serve that reuse.
"""

from __future__ import annotations

import array
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from hybrid_kv_plugin.sim.engine import SAMPLED_TOKEN


@dataclass(frozen=True)
class TraceRequest:
    request_id: str
    wave: int
    prompt_token_ids: tuple[int, ...]
    max_tokens: int = 1
    evict_gpu_before: bool = False

    def history(self) -> tuple[int, ...]:
        """Everything a later request can share with this one: the prompt, then the
        answer the simulator generates (``max_tokens`` copies of its sampled token)."""
        return self.prompt_token_ids + (SAMPLED_TOKEN,) * self.max_tokens


@dataclass(frozen=True)
class Segment:
    name: str
    requests: tuple[TraceRequest, ...]
    # None: the run-wide choice (``--eagle`` / geometry); True/False: this segment's own.
    eagle: bool | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)


# Prefix keys: a polynomial hash mod 2**64 over mixed token ids, then the end position mixed
# in. Mixing each token first leaves no structure for the polynomial's known weak inputs.
_KEY_BASE = np.uint64(0x100000001B3)
_KEY_MIX = np.uint64(0x9E3779B97F4A7C15)
_KEY_MIX2 = np.uint64(0xBF58476D1CE4E5B9)


def _mix(values: np.ndarray) -> np.ndarray:
    """A bijective scramble of uint64 values (splitmix64's finaliser)."""
    values = values * _KEY_MIX
    values ^= values >> np.uint64(31)
    values *= _KEY_MIX2
    values ^= values >> np.uint64(29)
    return values


class _KeyPowers:
    """BASE ** (i + 1) modulo 2**64, grown on demand and shared by every call."""

    table = np.cumprod(np.full(1 << 16, _KEY_BASE, dtype=np.uint64))

    @classmethod
    def get(cls, n: int) -> np.ndarray:
        while len(cls.table) < n:
            cls.table = np.concatenate([cls.table, cls.table[-1] * cls.table])
        return cls.table[:n]


def _as_uint64(tokens: Sequence[int], n: int) -> np.ndarray:
    if isinstance(tokens, array.array) and tokens.typecode in "bBhHiIlLqQ":
        return np.frombuffer(tokens, dtype=tokens.typecode, count=n).astype(np.uint64)
    if isinstance(tokens, np.ndarray):
        return tokens[:n].astype(np.uint64)
    return np.fromiter(tokens[:n] if n < len(tokens) else tokens, dtype=np.int64, count=n).astype(np.uint64)


def prefix_key_array(tokens: Sequence[int], unit: int, extra: int = 0, extra_token: int = 0) -> np.ndarray:
    """``keys[k]`` (uint64) identifies ``tokens[: unit * (k + 1)]`` (whole units only).

    ``extra``: that many copies of ``extra_token`` follow ``tokens`` (a request's answer),
    without building the longer sequence. Vectorised: one pass over the tokens in numpy,
    the same keys in every process (no Python ``hash``), equal prefixes give equal keys.
    """
    length = len(tokens)
    n = (length + extra) // unit * unit
    if n <= 0:
        return np.empty(0, dtype=np.uint64)
    values = np.empty(n, dtype=np.uint64)
    own = min(length, n)
    values[:own] = _as_uint64(tokens, own)
    values[own:] = np.uint64(extra_token)
    terms = _mix(values + np.uint64(1))
    terms *= _KeyPowers.get(n)
    sums = np.cumsum(terms, dtype=np.uint64)[unit - 1 :: unit]
    ends = np.arange(unit, n + 1, unit, dtype=np.uint64)
    return _mix(sums ^ _mix(ends))


def prefix_keys(tokens: Sequence[int], unit: int) -> list[int]:
    """``keys[k]`` identifies ``tokens[: unit * (k + 1)]`` (whole units only), as ints
    (see :func:`prefix_key_array`)."""
    return prefix_key_array(tokens, unit).tolist()


def history_keys(request: TraceRequest, unit: int) -> np.ndarray:
    """The prefix keys of ``request.history()`` (prompt, then its answer), without building it."""
    return prefix_key_array(request.prompt_token_ids, unit, request.max_tokens, SAMPLED_TOKEN)


def ideal_reuse(
    requests: Sequence[TraceRequest], hash_block_size: int, keys: Sequence[np.ndarray] | None = None
) -> dict[str, int]:
    """Per request: the longest prefix shared with any *earlier* request (list order),
    floored to the hash unit, leaving at least one prompt token to compute.

    Earlier requests contribute their whole history (prompt + generated answer): a
    conversation's next turn repeats the previous answer. ``keys``: each request's
    :func:`history_keys`, where the caller has them already.

    How: every key of every history, with the first request whose history holds it; a
    request's ideal is its leading prompt units whose key an earlier request held.
    """
    unit = hash_block_size
    if keys is None:
        keys = [history_keys(r, unit) for r in requests]
    if not requests:
        return {}
    flat = np.concatenate(keys) if keys else np.empty(0, dtype=np.uint64)
    counts = np.fromiter((len(k) for k in keys), dtype=np.int64, count=len(keys))
    owner = np.repeat(np.arange(len(keys), dtype=np.int32), counts)
    # Per key position: the earliest request holding that key. np.unique's first index lies in
    # it (flat is in request order); done per 1/16 of the key space, so the sort's working
    # memory is a sixteenth of the keys' (the full trace: 9.3 M keys).
    first_owner = np.empty(len(flat), dtype=np.int32)
    bucket = flat >> np.uint64(60)
    for part in range(16):
        where = np.flatnonzero(bucket == part)
        if where.size:
            _, first, inverse = np.unique(flat[where], return_index=True, return_inverse=True)
            first_owner[where] = owner[where[first]][inverse.reshape(-1)]
    del flat, bucket, owner
    ideal: dict[str, int] = {}
    offset = 0
    for number, request in enumerate(requests):
        limit_units = (len(request.prompt_token_ids) - 1) // unit
        earlier = first_owner[offset : offset + limit_units] < number
        shared = int(limit_units if earlier.all() else np.argmin(earlier))
        ideal[request.request_id] = shared * unit
        offset += int(counts[number])
    return ideal


# ---------------------------------------------------------------------------- the embedded default
def default_workload(seed: int = 0, scale: int = 1) -> list[Segment]:
    """Two segments, ``scale`` times over (31 requests per unit of scale).

    ``chat`` (no speculative decoding): conversations of four turns whose prompts end
    off the Mamba grid. Turns 1 and 3 follow a GPU-cache eviction, so their reuse (the
    previous turn's prompt and answer) can only come from the CPU tier; turn 2 finds it
    on the GPU. The conversations of one turn arrive together.

    ``agents`` (EAGLE): per family, a root request carrying a long system prompt; a first
    sibling while the root's blocks are on the GPU; a second sibling one wave later; then,
    after a GPU-cache eviction, two siblings that can only find the system prompt on the
    CPU tier. Siblings share the system prompt but not the root's task, so their reuse
    stops at a junction that only the junction checkpoint keeps a Mamba state for.
    """
    rng = random.Random(seed)

    def fresh(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(1, 1000) for _ in range(n))

    chat: list[TraceRequest] = []
    conversations = [fresh(rng.choice((150, 200, 250, 300))) for _ in range(4 * scale)]
    for turn in range(4):
        for number, history in enumerate(conversations):
            max_tokens = rng.choice((2, 4, 6))
            evict = turn in (1, 3)
            chat.append(TraceRequest(f"conv{number}-t{turn}", turn, history, max_tokens, evict_gpu_before=evict))
            conversations[number] = history + (SAMPLED_TOKEN,) * max_tokens + fresh(rng.choice((21, 37, 53, 70)))

    agents: list[TraceRequest] = []
    wave = 0
    for family in range(3 * scale):
        system = fresh(rng.choice((260, 330, 410)))
        agents.append(TraceRequest(f"agent{family}-root", wave, system + fresh(rng.choice((37, 45, 53))), 4))
        for k, sibling_wave in enumerate((wave + 1, wave + 2, wave + 3, wave + 3)):
            sibling = system + fresh(rng.choice((23, 45, 67)))
            evict = k == 2
            agents.append(TraceRequest(f"agent{family}-s{k}", sibling_wave, sibling, 2, evict_gpu_before=evict))
        wave += 4
    return [Segment("chat", tuple(chat), eagle=False), Segment("agents", tuple(agents), eagle=True)]


def workload_of_size(num_requests: int, seed: int = 0) -> list[Segment]:
    """The default mix scaled to at least ``num_requests`` requests (the benchmark's large run)."""
    per_scale = sum(len(s.requests) for s in default_workload(seed, 1))
    return default_workload(seed, max(1, -(-num_requests // per_scale)))


def with_eagle(segments: Sequence[Segment], eagle: bool | None) -> list[Segment]:
    """Force every segment's speculative setting (``None`` keeps each segment's own)."""
    if eagle is None:
        return list(segments)
    return [replace(s, eagle=eagle) for s in segments]


# ---------------------------------------------------------------------------- JSONL traces
TRACE_KEYS = frozenset(
    {"id", "tokens", "prefix_id", "prefix_len", "suffix_len", "continues", "max_tokens", "wave",
     "evict_gpu_before", "segment", "eagle"}
)


def load_trace(lines: Iterable[str]) -> list[Segment]:
    """JSONL, one request per line; see the README's "Trace format". Per line:

    * ``id`` (default ``line<N>``);
    * the prompt, one of: ``tokens`` (a list of token ids); ``prefix_id`` +
      ``prefix_len`` + ``suffix_len`` (lines with the same ``prefix_id`` share their first
      ``prefix_len`` tokens, the suffix is fresh); ``continues`` (the id of an earlier
      line: its prompt and generated answer) + ``suffix_len``;
    * optional ``max_tokens`` (1), ``wave`` (the line number), ``evict_gpu_before``
      (false), ``segment`` ("main"), ``eagle`` (unset: the run's ``--eagle`` choice).

    Segments keep the order of their first line; one segment's lines must agree on ``eagle``.
    A key outside :data:`TRACE_KEYS` (a typo such as ``max_token``) is an error naming its line.
    """
    prefixes: dict[str, tuple[int, ...]] = {}
    by_id: dict[str, TraceRequest] = {}
    segments: dict[str, list[TraceRequest]] = {}
    eagle: dict[str, bool | None] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            if not isinstance(item, dict):
                raise ValueError("each line must be a JSON object")
            unknown = sorted(set(item) - TRACE_KEYS)
            if unknown:
                raise ValueError(
                    f"unknown key(s) {', '.join(map(repr, unknown))} (allowed: {', '.join(sorted(TRACE_KEYS))})"
                )
            request_id = str(item.get("id", f"line{number}"))
            if request_id in by_id:
                raise ValueError(f"duplicate id {request_id!r}")
            tokens = _trace_prompt(item, request_id, number, prefixes, by_id)
            if not tokens:
                raise ValueError("empty prompt")
            max_tokens = int(item.get("max_tokens", 1))
            if max_tokens < 1:
                raise ValueError("max_tokens must be >= 1")
            request = TraceRequest(
                request_id, int(item.get("wave", number)), tokens, max_tokens, bool(item.get("evict_gpu_before", False))
            )
            name = str(item.get("segment", "main"))
            line_eagle = item.get("eagle")
            if line_eagle is not None and not isinstance(line_eagle, bool):
                raise ValueError("eagle must be true or false")
            if name in eagle and line_eagle is not None and eagle[name] not in (None, line_eagle):
                raise ValueError(f"segment {name!r} mixes eagle true and false")
            if eagle.get(name) is None:
                eagle[name] = line_eagle
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"trace line {number}: {exc}") from None
        by_id[request_id] = request
        segments.setdefault(name, []).append(request)
    return [Segment(name, tuple(reqs), eagle=eagle.get(name)) for name, reqs in segments.items()]


def _trace_prompt(
    item: dict, request_id: str, number: int, prefixes: dict[str, tuple[int, ...]], by_id: dict[str, TraceRequest]
) -> tuple[int, ...]:
    if "tokens" in item:
        return tuple(int(t) for t in item["tokens"])
    suffix = tuple(random.Random(f"{request_id}/{number}").randrange(1, 1000) for _ in range(int(item["suffix_len"])))
    if "continues" in item:
        earlier = by_id.get(str(item["continues"]))
        if earlier is None:
            raise ValueError(f"continues {item['continues']!r}: no earlier line has that id")
        return earlier.history() + suffix
    prefix_id = str(item["prefix_id"])
    prefix_len = int(item["prefix_len"])
    base = prefixes.get(prefix_id, ())
    if len(base) < prefix_len:
        generator = random.Random(f"prefix/{prefix_id}")
        base = tuple(generator.randrange(1, 1000) for _ in range(max(prefix_len, 4096)))
        prefixes[prefix_id] = base
    return base[:prefix_len] + suffix
