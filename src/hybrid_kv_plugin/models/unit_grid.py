"""The prefix-match units a resolved geometry allows: on the attention kernel's token grid,
dividing both the attention and the Mamba block (what ``--prefix-match-unit`` must satisfy)."""

from __future__ import annotations

from typing import Any


def _kernel_alignment() -> int:
    """The attention kernel's block-size grid (FlashAttention, the CUDA default for these models)."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    for size in FlashAttentionBackend.get_supported_kernel_block_sizes():
        base = getattr(size, "base", size)
        if isinstance(base, int) and base > 0:
            return base
    return 16


def accepted_units(geometry: Any) -> list[int]:
    """Units on the kernel grid that divide both resolved blocks, finest first."""
    step = _kernel_alignment()
    top = max(geometry.attention_block_size, geometry.mamba_block_size)
    return [
        unit
        for unit in range(step, top + 1, step)
        if geometry.attention_block_size % unit == 0 and geometry.mamba_block_size % unit == 0
    ]
