"""Full-attention partial keys at the prompt-tail positions the policy keeps.

A hit is the shortest over all KV-cache groups, so a Mamba state kept at a
position p inside an attention block serves nothing unless that attention block
is reachable at p too. The wheel registers one such partial key, at its own
prompt-tail position (N's last hash boundary on 0.29-0.31, the one <= N-1 on
0.32+). Attention KV is append-only, so the block holding p holds a valid prefix
at every p it has computed: adding keys at the other kept positions is safe.
"""

from __future__ import annotations

from typing import Any

from hybrid_kv_plugin.prompt_tail.policy import PromptTailPolicy


def add_partial_keys(manager: Any, request: Any, num_tokens: int, policy: PromptTailPolicy) -> None:
    """Key the attention block holding each kept sub-block position computed so far."""
    blocks = manager.req_to_blocks[request.request_id]
    for position in sorted(policy.kept(request.num_prompt_tokens)):
        index = position // manager.block_size
        if position > num_tokens or position % manager.block_size == 0 or index >= len(blocks):
            continue
        manager.block_pool.cache_partial_block(
            request=request,
            block=blocks[index],
            num_tokens=position,
            kv_cache_group_id=manager.kv_cache_group_id,
            block_size=manager.block_size,
        )
