"""Which full-attention partial block the CPU tier stores when a request with kept answer states finishes.

The connector stores whole attention blocks as the request computes them, and at
request finish one partial block: the one holding the prompt's last hash boundary
(that is where the wheel keys its own partial tail). With
``mamba_output_checkpoint`` the newest kept answer state may lie inside an
attention block, keyed there by ``prompt_tail_attention``: without that block on
the CPU tier, the next turn's CPU hit stops at the attention block before it.
An answer position later than the prompt's boundary means the prompt's block is
already whole (the request computed past it), so one partial block still suffices.
"""

from __future__ import annotations

from typing import Any

from hybrid_kv_plugin.output_checkpoint.rolling import REQUEST_ATTR


def last_answer_position(request: Any) -> int | None:
    """The newest answer position whose Mamba state the option kept for ``request``, if any."""
    groups = getattr(request, REQUEST_ATTR, None)
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
