"""Full-attention blocks keyed at a position inside them, where a feature keeps a Mamba state.

A hit is the shortest over all KV-cache groups, so a Mamba state kept at a position p
inside an attention block serves nothing unless that attention block is reachable at p
too. Attention KV is append-only, so the block holding p holds a valid prefix at every p
it has computed: keying it there is safe (prompt-tail positions, answer positions,
divergence points). This module keys such blocks in the GPU prefix cache and picks the
one a finishing request's CPU-tier store takes; the features decide the positions.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

# Where output_checkpoint.rolling keeps a request's answer states: {group id: [state with a
# ``position``]}. Read here, at every request's finish, by the CPU-tier stores.
ANSWER_STATES_ATTR = "hybrid_kv_output_states"


def keyable_inside_blocks(manager: Any) -> bool:
    """Whether ``manager`` can be keyed inside its blocks: exactly full attention. Its subclasses
    (sliding, ring, sparse) free or reuse blocks, so a hit there must end on their block grid."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    return type(manager) is FullAttentionManager


def carries_key_objects(pool: Any, block: Any, primary: Any, secondary: Collection[Any]) -> bool:
    """Whether ``block`` still answers to the very key objects recorded when a store was queued:
    ``primary`` as its own hash, exactly ``secondary`` as its secondary (partial) keys in ``pool``.

    Compared by identity: a block evicted and handed to a request with the same prefix is keyed
    again with equal keys (new objects) before that request writes it, so equal keys alone would
    copy a block being rewritten. The caller holds the recorded objects, so no new key takes their ids.
    """
    if block.block_hash is not primary:
        return False
    now = pool.cached_block_hashes_by_block.get(block.block_id, ())
    if len(now) != len(secondary):
        return False
    recorded = {id(key) for key in secondary}
    return all(id(key) in recorded for key in now)


def key_attention_block(manager: Any, request: Any, position: int) -> None:
    """Key the attention block holding ``position`` there (nothing at a block end: a full key)."""
    blocks = manager.req_to_blocks[request.request_id]
    index = position // manager.block_size
    if position % manager.block_size == 0 or index >= len(blocks):
        return
    manager.block_pool.cache_partial_block(
        request=request,
        block=blocks[index],
        num_tokens=position,
        kv_cache_group_id=manager.kv_cache_group_id,
        block_size=manager.block_size,
    )


def last_answer_position(request: Any) -> int | None:
    """The newest answer position whose Mamba state ``mamba_output_checkpoint`` kept for ``request``, if any."""
    groups = getattr(request, ANSWER_STATES_ATTR, None)
    if not groups:  # asked at every request's finish: most kept none (or the option is off)
        return None
    return max((state.position for states in groups.values() for state in states), default=None)


def attention_tail_boundary(request: Any, hash_block_size: int) -> int:
    """Where the request's attention partial tail is keyed: its newest kept answer position,
    else the prompt's last hash boundary."""
    answer = last_answer_position(request)
    return answer if answer is not None else request.num_prompt_tokens // hash_block_size * hash_block_size


def partial_tail_block(offload: Any, request: Any, block_ids: Any, boundary: int) -> Any:
    """The full-attention GPU block holding ``boundary`` inside it, when keyed there and not yet stored.

    The connector stores whole attention blocks as the request computes them, and at its
    finish one partial block: the one holding the prompt's last hash boundary (where the
    wheel keys its own partial tail), or with ``mamba_output_checkpoint`` the newest kept
    answer state's (without that block on the CPU tier the next turn's CPU hit stops at the
    attention block before it). An answer position past the prompt's boundary means the
    prompt's block is already whole, so one partial block suffices.
    ``offload``: the SimpleCPU scheduler side (0.29 backport or the wheel's own, same fields).
    """
    gpu_pool = offload._gpu_block_pool
    if boundary == 0 or boundary > request.num_computed_tokens or boundary % offload.fa_block_size == 0:
        return None
    ids = block_ids[offload.fa_gidx]
    index = boundary // offload.fa_block_size
    if index >= len(ids):
        return None
    block = gpu_pool.blocks[ids[index]]
    if block.is_null or block.block_id in offload._in_flight_store_gpu_blocks:
        return None
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    key = make_block_hash_with_group_id(request.block_hashes[boundary // offload.hash_block_size - 1], offload.fa_gidx)
    if block.block_hash != key and key not in gpu_pool.cached_block_hashes_by_block.get(block.block_id, ()):
        return None  # the GPU side did not register that boundary on this block
    if offload.cpu_block_pool.cached_block_hash_to_block.get_one_block(key) is not None:
        return None
    return block
