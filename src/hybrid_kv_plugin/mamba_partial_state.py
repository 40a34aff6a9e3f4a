"""Keeping the Mamba state a chunk just wrote at a sub-block position (junction, prompt tail, answer).

The model runner writes a request's Mamba state, at the end of every scheduled
chunk, into the block holding its last token (``block_table[(seq_len - 1) //
block_size]`` in ``mamba_utils``). So once a chunk ends at position ``p``, block
``p // block_size`` holds the state after ``p`` tokens until the next forward pass
overwrites it. Keeping it takes what the wheel does for its own partial tail:
register a partial prefix-cache key on that block, and mark the request so the
next allocation copies the state out (copy-on-write) before the forward pass -
the copy is also handed to a connector as a boundary state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# The manager attributes keep_partial_state touches; a patch calling it fingerprints these
# (the stock partial-tail method must touch them too, with the same meaning).
KEEP_PARTIAL_STATE_READS = frozenset(
    {"block_pool", "block_size", "kv_cache_group_id", "req_to_blocks", "_partial_hit_reqs", "num_cached_block",
     "_producer_partial_tail_reqs"}
)


def keep_partial_state(manager: Any, request: Any, num_tokens: int, producer_holds_block: bool | None) -> Any:
    """Register the state after ``num_tokens`` tokens; the prefix-cache key, or None if not kept.

    Requires ``num_tokens`` to end the chunk being cached and not to be a multiple
    of the Mamba block (block ends are full-block entries the wheel caches itself).
    ``producer_holds_block``: how the wheel's manager records a partial tail it offers a
    connector (the block and position, or the position only); None where it records none (0.26).
    """
    index = num_tokens // manager.block_size
    blocks: Sequence[Any] = manager.req_to_blocks[request.request_id]
    if index >= len(blocks) or blocks[index].is_null:
        return None
    holder = blocks[index]
    key = cache_partial_key(manager, request, holder, num_tokens)
    if key is None:
        return None
    manager._partial_hit_reqs[request.request_id] = (index, holder)
    manager.num_cached_block[request.request_id] = index
    if producer_holds_block is not None:
        manager._producer_partial_tail_reqs[request.request_id] = (
            (holder, num_tokens) if producer_holds_block else num_tokens
        )
    return key


def cache_partial_key(manager: Any, request: Any, block: Any, num_tokens: int) -> Any:
    """Key ``block`` of ``manager``'s group as the state after ``num_tokens`` of ``request``
    (the wheel's ``cache_partial_block``); None where the wheel declines the key."""
    return manager.block_pool.cache_partial_block(
        request=request,
        block=block,
        num_tokens=num_tokens,
        kv_cache_group_id=manager.kv_cache_group_id,
        block_size=manager.block_size,
    )
