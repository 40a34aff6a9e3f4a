"""Full-attention partial keys at every prefix-match-unit boundary a request computes.

A later request's lookup finds where it leaves the cached prefix only as precisely
as the attention blocks are keyed: at their block ends, plus the one partial key the
wheel registers (the prompt tail). With attention blocks as coarse as the Mamba block
(``align`` mode sets them equal: 544 tokens on Qwen3-Next) every divergence it can
see is a Mamba block end, where the wheel already keeps a state. Keyed at every
unit, the lookup sees the divergence to the unit, and the Mamba state kept there
(the junction stop) serves the next request sharing the prefix.

Attention KV is append-only, so a block holds a valid prefix at every position it
has computed. The block pool keeps a block's partial keys only while none deeper
comes: a key deeper than the block's primary one drops every key of the block, and
so does the block's promotion to a full key when it fills. So the interior keys of
a block are (re)written deepest first whenever a chunk reaches into it or fills it
(a chunk that ends inside a block and the next one's deeper keys or its promotion
would otherwise leave only the last chunk's, or none), and once more when the block
holding the prompt's end fills with answer tokens and is hashed (the wheel re-keys
its own prompt-tail key there the same way). The lookup probes the interior unit
boundaries of the first block that is not a full hit, so each extra key costs a
dictionary entry, nothing on the lookup path.

Invariant: once a request's prompt is keyed, every unit boundary of its prompt that
lies inside an attention block of it carries a partial key, until the block is evicted.
A preempted request forgets where keying stopped (``divergence_keys_after_preemption``),
so its recomputed blocks are keyed again. Known limit: the first call keys the blocks
of a request's prefix hit too (vLLM sets ``num_computed_tokens`` after the allocation
that calls this): no-op keys, and a request admitted in the same step whose hit ends
inside one of those blocks waits a step (``patches/local_hit_admission.py``).
"""

from __future__ import annotations

from typing import Any

# On the request: the number of computed tokens below which keying has nothing to do (the next
# unit boundary of the prompt, then the end of the block holding the prompt's end, then never).
# Read and written with getattr/setattr, never through ``request.__dict__``: on CPython 3.11 that
# moves the request's attributes off inline storage, and every read vLLM makes of it
# afterwards takes ~1.9x as long (measured on 0.33's Request).
REQUEST_ATTR = "hybrid_kv_unit_keyed"
# On the request: (the prompt position keyed up to, the request's preemptions when keyed).
PROGRESS_ATTR = "hybrid_kv_unit_keyed_progress"
_NEVER = 1 << 62


def key_unit_boundaries(manager: Any, request: Any, num_tokens: int) -> None:
    """Key the attention blocks holding each unit boundary of the prompt up to ``num_tokens``."""
    if num_tokens < getattr(request, REQUEST_ATTR, 0):
        return  # every step of every running request passes here: one read, one comparison
    unit, size = manager.block_pool.hash_block_size, manager.block_size
    hashed = len(request.block_hashes) * unit  # the wheel keys and promotes blocks only up to here
    top = min(request.num_prompt_tokens, hashed) // unit * unit
    progress = getattr(request, PROGRESS_ATTR, None)
    preemptions = getattr(request, "num_preemptions", 0)
    if progress is None or progress[1] != preemptions:
        # First call, or the request was preempted and recomputes: positions below its
        # computed tokens came from a prefix hit.
        progress = (request.num_computed_tokens, preemptions)
    keyed = progress[0]
    limit = min(num_tokens, top)
    if limit > keyed:
        # Every block holding a new boundary, and the block the last call ended in: a deeper
        # key, or the block's promotion to full as this chunk filled it, dropped its keys.
        for index in range(keyed // size, limit // size + 1):
            _key_block_interior(manager, request, index, min(limit, (index + 1) * size - unit))
        keyed = limit
    elif keyed >= top and top % size and min(num_tokens, hashed) >= (top // size + 1) * size:
        # The block holding the prompt's end filled (answer tokens) and, its tokens hashed, was
        # promoted to a full key, which dropped the interior keys.
        _key_block_interior(manager, request, top // size, top)
        keyed = _NEVER
    setattr(request, PROGRESS_ATTR, (keyed, preemptions))
    if keyed < top:
        next_at = keyed // unit * unit + unit  # the next unit boundary
    elif keyed < _NEVER and top % size:
        next_at = (top // size + 1) * size
    else:
        next_at = _NEVER
    setattr(request, REQUEST_ATTR, next_at)


def forget_keying_progress(request: Any) -> None:
    """After a preemption: the next call re-reads the request's progress (it recomputes into new blocks)."""
    if getattr(request, REQUEST_ATTR, 0):
        setattr(request, REQUEST_ATTR, 0)


def _key_block_interior(manager: Any, request: Any, index: int, deepest: int) -> None:
    """Key block ``index``'s interior unit boundaries up to ``deepest``, deepest first: each
    shallower key then joins the block's keys instead of dropping them."""
    blocks = manager.req_to_blocks[request.request_id]
    if index >= len(blocks):
        return
    pool, size, group = manager.block_pool, manager.block_size, manager.kv_cache_group_id
    unit = pool.hash_block_size
    block = blocks[index]
    for position in range(deepest // unit * unit, index * size, -unit):
        if position % size:
            pool.cache_partial_block(
                request=request, block=block, num_tokens=position, kv_cache_group_id=group, block_size=size
            )
