"""How much of a workload's reuse a CPU tier of a given size can keep, in a model of the tier alone.

A block model of the tier, outside vLLM, for sizing it: per segment (a fresh tier each, as the
replay runs them), requests one after another in arrival order; each looks up the longest
cached prefix of whole attention blocks of its prompt (at least one prompt token left to
compute), then stores every whole block of its prompt and answer. Attention blocks only: no
Mamba state takes room and the GPU cache serves nothing. Its sizes are a floor for a hybrid
tier (measured: where its LRU keeps 0.95, the replay's plugin keeps 0.82-0.84; docs/replay.md).
Two eviction orders:

* ``lru``: least recently used first; a request's blocks are touched deepest first, so a
  prefix's root outlives its tail (vLLM's block pools free a request's blocks tail first).
* ``offline``: Belady's rule, which knows the future: a block is admitted only when its next
  use comes before that of some block held, and the held block used furthest in the future
  (deepest on a tie) is evicted. A block is never used after its descendants, so the tier
  stays prefix-closed and every block held at its next use is a hit. No online order keeps
  more than this.

The ideal is the same model with an unbounded tier: every whole prompt block that an earlier
history (prompt and answer) of the segment computed.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hybrid_kv_plugin.sim.workload import history_keys, ideal_reuse

# Shares of the ideal the report finds the smallest tier for, per order (the reuse goals of issue #31).
TARGET_SHARES = (0.90, 0.95)
_NEVER = float("inf")


@dataclass(frozen=True)
class _Request:
    """One request as the model sees it: its history's block keys, and how many leading ones an
    unbounded tier serves it (its ideal; no tier serves more)."""

    keys: tuple[int, ...]
    ideal: int


@dataclass(frozen=True)
class _Segment:
    requests: list[_Request]
    # {block key: the requests (arrival indices) whose ideal holds it}: where holding it is a hit.
    uses: dict[int, list[int]]


@dataclass(frozen=True)
class TierCeiling:
    """What a tier of ``tier_blocks`` blocks of ``block_tokens`` tokens keeps, in tokens."""

    block_tokens: int
    tier_blocks: int
    ideal_tokens: int
    lru_tokens: int
    offline_tokens: int
    # {share of the ideal: the smallest tier (blocks) where LRU keeps it}; blocks past what the
    # workload ever stores are never needed, so every share is found.
    lru_blocks_for: dict[float, int]
    # The same for the offline optimum: the least tier any order could do it with.
    offline_blocks_for: dict[float, int]

    def share(self, tokens: int) -> float:
        return tokens / self.ideal_tokens if self.ideal_tokens else 1.0

    def as_dict(self, block_bytes: float | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": "attention blocks only, requests in arrival order, a fresh tier per segment",
            "block_tokens": self.block_tokens,
            "tier_blocks": self.tier_blocks,
            "ideal_tokens": self.ideal_tokens,
            "lru_tokens": self.lru_tokens,
            "lru_efficiency": round(self.share(self.lru_tokens), 3),
            "offline_tokens": self.offline_tokens,
            "offline_efficiency": round(self.share(self.offline_tokens), 3),
            "lru_blocks_for": {f"{s:.2f}": n for s, n in self.lru_blocks_for.items()},
            "offline_blocks_for": {f"{s:.2f}": n for s, n in self.offline_blocks_for.items()},
        }
        if block_bytes is not None:
            out["block_bytes"] = round(block_bytes)
        return out


def _segment(requests: Sequence[Any], block_tokens: int) -> _Segment:
    keys = [history_keys(r, block_tokens) for r in requests]
    # The replay's own ideal, at the block instead of the prefix-match unit.
    ideal = ideal_reuse(requests, block_tokens, keys)
    modelled = [_Request(tuple(k.tolist()), ideal[r.request_id] // block_tokens) for r, k in zip(requests, keys)]
    uses: dict[int, list[int]] = {}
    for t, r in enumerate(modelled):
        for key in r.keys[: r.ideal]:
            uses.setdefault(key, []).append(t)
    return _Segment(modelled, uses)


def _leading_held(r: _Request, held: Any) -> int:
    n = 0
    while n < r.ideal and r.keys[n] in held:
        n += 1
    return n


def lru_blocks(segment: _Segment, capacity: int) -> int:
    """Blocks an LRU tier of ``capacity`` blocks serves (see the module docstring)."""
    tier: OrderedDict[int, None] = OrderedDict()
    total = 0
    for r in segment.requests:
        total += _leading_held(r, tier)
        for key in reversed(r.keys):
            if key in tier:
                tier.move_to_end(key)
            else:
                tier[key] = None
        while len(tier) > capacity:
            tier.popitem(last=False)
    return total


def offline_blocks(segment: _Segment, capacity: int) -> int:
    """Blocks a tier of ``capacity`` blocks serves under Belady's rule (see the module docstring)."""
    uses = segment.uses
    cursor = dict.fromkeys(uses, 0)
    held: dict[int, tuple[float, int]] = {}  # key -> (next use, depth): its current eviction rank
    heap: list[tuple[float, int, int]] = []  # (-next use, -depth, key); stale entries are skipped
    total = 0
    for t, r in enumerate(segment.requests):
        total += _leading_held(r, held)
        for depth, key in enumerate(r.keys):
            times = uses.get(key)
            if times is None:
                rank: tuple[float, int] = (_NEVER, depth)
            else:
                i = cursor[key]
                while i < len(times) and times[i] <= t:
                    i += 1
                cursor[key] = i
                rank = (times[i] if i < len(times) else _NEVER, depth)
            if key in held:
                if rank[0] == _NEVER:
                    del held[key]
                    continue
                held[key] = rank
            elif rank[0] == _NEVER or capacity <= 0:
                continue
            elif len(held) >= capacity:
                while (-heap[0][0], -heap[0][1]) != held.get(heap[0][2]):
                    heapq.heappop(heap)
                worst = heap[0]
                if (-worst[0], -worst[1]) <= rank:
                    continue  # everything held is needed sooner: bypass
                heapq.heappop(heap)
                del held[worst[2]]
                held[key] = rank
            else:
                held[key] = rank
            heapq.heappush(heap, (-rank[0], -rank[1], key))
    return total


def _smallest_tier(
    order: Callable[[_Segment, int], int], segments: Sequence[_Segment], ideal: int, share: float, most: int
) -> int:
    """The fewest blocks with which ``order`` keeps ``share`` of ``ideal``. Neither order keeps less with
    more room: LRU's tier at n blocks is the top n of one recency stack, and the optimum's count is the
    best any order can do, which a larger tier can always match."""
    low, high = 0, most
    while low < high:
        mid = (low + high) // 2
        if sum(order(seg, mid) for seg in segments) >= share * ideal:
            high = mid
        else:
            low = mid + 1
    return low


def tier_ceiling(segments: Sequence[Any], block_tokens: int, tier_blocks: int) -> TierCeiling:
    """The model's figures for ``segments`` (each with ``requests`` in arrival order)."""
    if block_tokens < 1 or tier_blocks < 0:
        raise ValueError(f"block_tokens must be >= 1 and tier_blocks >= 0, got {block_tokens} and {tier_blocks}")
    per_segment = [_segment(s.requests, block_tokens) for s in segments]
    ideal = sum(r.ideal for seg in per_segment for r in seg.requests)
    # A tier that holds every block the workload stores never evicts: LRU keeps the ideal there.
    most = max((len({k for r in seg.requests for k in r.keys}) for seg in per_segment), default=0)
    return TierCeiling(
        block_tokens=block_tokens,
        tier_blocks=tier_blocks,
        ideal_tokens=ideal * block_tokens,
        lru_tokens=sum(lru_blocks(seg, tier_blocks) for seg in per_segment) * block_tokens,
        offline_tokens=sum(offline_blocks(seg, tier_blocks) for seg in per_segment) * block_tokens,
        lru_blocks_for={s: _smallest_tier(lru_blocks, per_segment, ideal, s, most) for s in TARGET_SHARES},
        offline_blocks_for={s: _smallest_tier(offline_blocks, per_segment, ideal, s, most) for s in TARGET_SHARES},
    )
