"""Workloads for ``hybrid-kv replay``: the embedded default, JSONL traces, and the ideal reuse.

A workload is a list of :class:`TraceRequest` grouped in *waves*: a wave's requests arrive
together and run to completion before the next wave; ``evict_gpu_before`` empties the GPU
prefix cache first (what GPU-cache pressure does in a long-running server), so only the
CPU tier can serve the wave's reuse.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hybrid_kv_plugin.sim.engine import SAMPLED_TOKEN


@dataclass(frozen=True)
class TraceRequest:
    request_id: str
    wave: int
    prompt_token_ids: tuple[int, ...]
    max_tokens: int = 1
    evict_gpu_before: bool = False


def ideal_reuse(requests: Sequence[TraceRequest], hash_block_size: int) -> dict[str, int]:
    """Per request: the longest prefix shared with any *earlier* request, floored to the hash
    unit, leaving at least one prompt token to compute.

    Earlier requests contribute their prompt and the output tokens the simulator generates
    for them (a conversation's next turn repeats the previous answer).
    """
    seen: set[tuple[int, ...]] = set()
    ideal: dict[str, int] = {}
    for request in requests:
        tokens = request.prompt_token_ids
        limit = (len(tokens) - 1) // hash_block_size * hash_block_size
        shared = 0
        while shared + hash_block_size <= limit and tokens[: shared + hash_block_size] in seen:
            shared += hash_block_size
        ideal[request.request_id] = shared
        history = tokens + (SAMPLED_TOKEN,) * request.max_tokens
        for end in range(hash_block_size, len(history) + 1, hash_block_size):
            seen.add(history[:end])
    return ideal


def default_workload(seed: int = 0, scale: int = 1) -> list[TraceRequest]:
    """Multi-turn conversations whose prompts end off the Mamba grid, agentic siblings sharing a
    long system prompt, and waves that follow a GPU-cache eviction so the CPU tier must serve."""
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    wave = 0

    def fresh(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(1, 1000) for _ in range(n))

    for conversation in range(4 * scale):
        history = fresh(rng.choice((150, 200, 250, 300)))
        for turn in range(3):
            max_tokens = rng.choice((2, 4, 6))
            out.append(TraceRequest(f"conv{conversation}-t{turn}", wave, history, max_tokens, evict_gpu_before=turn > 0))
            wave += 1
            history = history + (SAMPLED_TOKEN,) * max_tokens + fresh(rng.choice((21, 37, 53, 70)))
    for family in range(3 * scale):
        system = fresh(rng.choice((260, 330, 410)))
        out.append(TraceRequest(f"agent{family}-root", wave, system + fresh(19), 4))
        wave += 1
        siblings = [TraceRequest(f"agent{family}-s{k}", wave, system + fresh(rng.choice((23, 45, 67))), 2, evict_gpu_before=k == 0) for k in range(3)]
        out.extend(siblings)
        wave += 1
    return out


def load_trace(lines: Iterable[str]) -> list[TraceRequest]:
    """JSONL, one request per line. Either ``{"id", "tokens": [...]}`` or the synthetic form
    ``{"id", "prefix_id", "prefix_len", "suffix_len"}`` (requests with the same ``prefix_id``
    share their first ``prefix_len`` tokens). Optional: ``wave`` (default: one wave per line),
    ``max_tokens`` (default 1), ``evict_gpu_before`` (default false)."""
    prefixes: dict[str, tuple[int, ...]] = {}
    out: list[TraceRequest] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            request_id = str(item.get("id", f"line{number}"))
            if "tokens" in item:
                tokens = tuple(int(t) for t in item["tokens"])
            else:
                prefix_id = str(item["prefix_id"])
                rng = random.Random(f"{prefix_id}")
                prefix_len = int(item["prefix_len"])
                base = prefixes.setdefault(prefix_id, tuple(rng.randrange(1, 1000) for _ in range(4096)))
                suffix_rng = random.Random(f"{request_id}/{number}")
                tokens = base[:prefix_len] + tuple(suffix_rng.randrange(1, 1000) for _ in range(int(item["suffix_len"])))
            if not tokens:
                raise ValueError("empty prompt")
            out.append(
                TraceRequest(
                    request_id,
                    int(item.get("wave", number)),
                    tokens,
                    int(item.get("max_tokens", 1)),
                    bool(item.get("evict_gpu_before", False)),
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"trace line {number}: {exc}") from None
    return out
