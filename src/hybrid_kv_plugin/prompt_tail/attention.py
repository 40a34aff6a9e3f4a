"""Full-attention partial keys at the sub-block positions the plugin keeps Mamba states at.

A hit is the shortest over all KV-cache groups, so a Mamba state kept at a
position p inside an attention block serves nothing unless that attention block
is reachable at p too. The wheel registers one such partial key, at its own
prompt-tail position (N's last hash boundary on 0.29-0.31, the one <= N-1 on
0.32+). Attention KV is append-only, so the block holding p holds a valid prefix
at every p it has computed: adding keys at the other kept positions (the prompt
tail's, ``prompt_tail_checkpoint``; an answer's, ``mamba_output_checkpoint``) is safe.
"""

from __future__ import annotations

from typing import Any

from hybrid_kv_plugin.prompt_tail.policy import PromptTailPolicy


def keyable_inside_blocks(manager: Any) -> bool:
    """Whether ``manager`` can be keyed inside its blocks: exactly full attention. Its subclasses
    (sliding, ring, sparse) free or reuse blocks, so a hit there must end on their block grid."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    return type(manager) is FullAttentionManager


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


def add_partial_keys(manager: Any, request: Any, num_tokens: int, policy: PromptTailPolicy) -> None:
    """Key the attention block holding each kept prompt-tail position computed so far."""
    for position in sorted(policy.kept(request.num_prompt_tokens)):
        if position <= num_tokens:
            key_attention_block(manager, request, position)
