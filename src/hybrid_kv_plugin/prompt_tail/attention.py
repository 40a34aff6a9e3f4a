"""Full-attention partial keys at the prompt-tail positions ``prompt_tail_checkpoint`` keeps.

The wheel registers one partial key inside an attention block, at its own prompt-tail
position (N's last hash boundary on 0.29-0.31, the one <= N-1 on 0.32+); the value's other
kept positions get one too (why that is safe: :mod:`hybrid_kv_plugin.attention_partial_block`).
"""

from __future__ import annotations

from typing import Any

from hybrid_kv_plugin.attention_partial_block import key_attention_block
from hybrid_kv_plugin.prompt_tail.policy import PromptTailPolicy


def add_partial_keys(manager: Any, request: Any, num_tokens: int, policy: PromptTailPolicy) -> None:
    """Key the attention block holding each kept prompt-tail position computed so far."""
    for position in sorted(policy.kept(request.num_prompt_tokens)):
        if position <= num_tokens:
            key_attention_block(manager, request, position)
