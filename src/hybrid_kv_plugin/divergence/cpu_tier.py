"""The divergence point of a request whose attention hit is on the CPU tier only.

vLLM sets ``request.shared_prefix_boundary`` (where the longest single-group hit ends)
from the GPU prefix cache lookup alone. When the GPU cache has dropped a prefix that the
CPU tier still holds, the tier's attention KV can reach past the deepest Mamba state it
holds, and the request then recomputes from that state without keeping one at the point
where its attention hit ended: the next request sharing the prefix recomputes the same
tokens again.

The CPU tier's own coordinator already computes that reach (the third value of
``find_longest_cache_hit``: attention tokens cached past the reconciled hit, which the
wheel's KVCacheManager turns into the point for the GPU lookup) and the wheel's SimpleCPU
scheduler drops it. :class:`CpuTierReach` records it for the lookup the
connector is answering and moves the request's divergence point there when it lies
deeper than the one the GPU lookup set. The scheduler computes the request's first chunk
after the connector answered, so the chunk ends there and the Mamba manager keeps the
state, as for a GPU-cache divergence.

Invariant: the point is ``num_computed_tokens + hit + reach`` of one lookup on the
request's own block hashes, a prefix-match-unit multiple below the request's length; it
only ever moves deeper than the GPU lookup's, never past what the tier holds.
Attached per connector instance (the coordinator method is wrapped on the instance);
nothing of vLLM's classes changes.
"""

from __future__ import annotations

import logging
from typing import Any

from hybrid_kv_plugin._log import log_once


class CpuTierReach:
    """Remembers how far the CPU tier's attention KV reached in the lookup being answered."""

    def __init__(self, coordinator: Any) -> None:
        self._find = coordinator.find_longest_cache_hit
        coordinator.find_longest_cache_hit = self._find_longest_cache_hit
        # The last lookup's result (blocks, combined hit, attention tokens past it), kept only
        # when the attention reached past the hit (None otherwise, as for most lookups).
        self._last: Any = None

    def _find_longest_cache_hit(self, block_hashes: Any, max_cache_hit_length: int) -> Any:
        result = self._find(block_hashes, max_cache_hit_length)
        self._last = result if result[2] > 0 else None
        return result

    def begin(self) -> None:
        """Before the lookup: forget any earlier call of the coordinator (the Mooncake connector's
        store survey runs the same lookup), so a lookup the wheel skips (misaligned local prefix)
        records nothing."""
        self._last = None

    def apply(self, request: Any, num_computed_tokens: int) -> None:
        """After the lookup: move ``request``'s divergence point to the tier's attention reach."""
        last, self._last = self._last, None
        if last is None:
            return
        point = num_computed_tokens + last[1] + last[2]
        if point > request.shared_prefix_boundary and point < request.num_prompt_tokens:
            request.shared_prefix_boundary = point


def attach_cpu_tier_reach(connector: Any) -> CpuTierReach | None:
    """Track the CPU tier's attention reach on ``connector``'s scheduler side (None: nothing to track)."""
    manager = getattr(connector, "scheduler_manager", None)
    coordinator = getattr(manager, "cpu_coordinator", None)
    if coordinator is None or not hasattr(coordinator, "find_longest_cache_hit"):
        log_once(
            logging.INFO,
            "hybrid-kv-plugin: mamba_divergence_checkpoint: this connector has no CPU-tier coordinator; "
            "divergence points come from the GPU prefix cache only"
        )
        return None
    return CpuTierReach(coordinator)
