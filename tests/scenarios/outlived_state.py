"""A Mamba state that outlives every attention key at its position (same-step hit cases)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def state_without_attention(engine: Any, prompt: Sequence[int], state_at: int, filler: Sequence[int]) -> None:
    """Run ``prompt`` (its prompt-end Mamba state at ``state_at``), then ``filler`` while a request holds
    that state (the test touches its block, as a running request's hit does): the filler evicts the
    prompt's attention blocks, and the state, freed after it, outlives every attention key at its position."""
    p = engine.add_request("p", list(prompt), max_tokens=1)
    engine.run_until_idle()
    pool = engine.gpu_block_pool
    key = p.block_hashes[state_at // pool.hash_block_size - 1]
    state = pool.get_cached_block(key, [1])
    assert state is not None and pool.get_cached_block(key, [0]) is not None
    pool.touch(state)
    engine.run([("filler", list(filler))])
    pool.free_blocks(state)
    assert (pool.get_cached_block(key, [1]), pool.get_cached_block(key, [0])) == (state, None)
