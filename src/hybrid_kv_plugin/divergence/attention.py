"""Full-attention partial keys at every prefix-match-unit boundary a request computes.

A later request's lookup finds where it leaves the cached prefix only as precisely
as the attention blocks are keyed: at their block ends, plus the one partial key the
wheel registers (the prompt tail). With attention blocks as coarse as the Mamba block
(``align`` mode sets them equal: 544 tokens on Qwen3-Next) every divergence it can
see is a Mamba block end, where the wheel already keeps a state. Keyed at every
unit, the lookup sees the divergence to the unit, and the Mamba state kept there
(the junction stop) serves the next request sharing the prefix.

Attention KV is append-only, so a block holds a valid prefix at every position it
has computed; the block pool keeps any number of partial keys per block and drops
them all when the block is evicted. The lookup probes the interior unit boundaries
of the first block that is not a full hit, so each extra key costs a dictionary
entry, nothing on the lookup path.
"""

from __future__ import annotations

from typing import Any

# On the request: the position up to which its attention blocks are unit-keyed. Read and
# written with getattr/setattr, never through ``request.__dict__``: on CPython 3.11 that
# moves the request's attributes off inline storage, and every read vLLM makes of it
# afterwards takes ~1.9x as long (measured on 0.33's Request).
REQUEST_ATTR = "hybrid_kv_unit_keyed"


def key_unit_boundaries(manager: Any, request: Any, num_tokens: int) -> None:
    """Key the attention block holding each unit boundary in (already keyed, ``num_tokens``] of the prompt."""
    unit = manager.block_pool.hash_block_size
    limit = min(num_tokens, request.num_prompt_tokens, len(request.block_hashes) * unit)
    done = getattr(request, REQUEST_ATTR, None)
    if done is None:
        done = request.num_computed_tokens
    if limit <= done:
        return
    blocks = manager.req_to_blocks[request.request_id]
    pool, size, group = manager.block_pool, manager.block_size, manager.kv_cache_group_id
    for position in range((done // unit + 1) * unit, limit + 1, unit):
        index = position // size
        if position % size == 0 or index >= len(blocks):
            continue
        pool.cache_partial_block(
            request=request, block=blocks[index], num_tokens=position, kv_cache_group_id=group, block_size=size
        )
    setattr(request, REQUEST_ATTR, limit)
