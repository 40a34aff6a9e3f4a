"""The most KV-cache blocks a workload can ever take, so a pool sized past it can be cut to it.

vLLM's block pools hand out never-used blocks first (free blocks queue at the tail, new
blocks leave from the head) and evict a cached block only when the never-used ones are gone.
A pool at least as large as every allocation a workload makes therefore never evicts, and
runs exactly as a larger one: the replay result is the same, without building millions of
block objects (the shipped tiny model at 40 GiB resolves to 10,485,760 blocks of 4 KiB).
The SimpleCPU tier's pool is the same kind of pool and stores at most what the GPU computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# A pool resolved past this many blocks is worth a warning: no real deployment's KV cache
# has this many (an 80B hybrid model gets 3,212 at 40 GiB), so the geometry is a toy one.
ABSURD_BLOCKS = 1_000_000


def blocks_a_workload_can_take(
    segments: Sequence[Any],
    *,
    attention_block_size: int,
    mamba_block_size: int,
    max_num_batched_tokens: int,
    num_speculative_tokens: int = 1,
    mamba_groups: int = 1,
) -> int:
    """An upper bound on the blocks every request of ``segments`` allocates over a whole run,
    every KV-cache group (full attention with its draft layer, and each Mamba group), plus the null block.

    Per request and group: its tokens (prompt, answer, speculative look-ahead) in that group's
    blocks, one per prefill chunk (align mode keeps a state block where a chunk ends) and two
    of slack for the blocks a step allocates ahead.
    """
    block = min(attention_block_size, mamba_block_size)
    total = 1
    for segment in segments:
        for request in segment.requests:
            prompt = len(request.prompt_token_ids)
            tokens = prompt + request.max_tokens + num_speculative_tokens + 1
            chunks = -(-prompt // max(max_num_batched_tokens, 1))
            total += (1 + mamba_groups) * (-(-tokens // block) + chunks + 2)
    return total
