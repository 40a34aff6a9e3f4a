"""The chunk stops the junction checkpoint adds to the wheel's own Mamba split.

The wheel's ``_mamba_block_aligned_split`` keeps deciding the chunk; this module
only answers "is there an earlier position inside that chunk where the state must
be materialised?". Every stop the wheel makes is kept, so a state the stock split
would cache is still cached; the switch can only add states.
"""

from __future__ import annotations

from typing import Any

from hybrid_kv_plugin.junction.gate import JunctionPlan, lowered_tail


def last_pinned_boundary(request: Any, block_size: int, eagle_drop: bool) -> int:
    """The last block boundary below which the stock split keeps chunk ends on the grid.

    Under EAGLE block drop a hit never reaches the last full block, so the stock
    split pins one block lower; the prompt-tail stop only matters above this.
    """
    boundary = request.num_tokens // block_size * block_size
    return max(boundary - block_size, 0) if eagle_drop else boundary


def junction_stop(
    plan: JunctionPlan,
    request: Any,
    start: int,
    end: int,
    *,
    block_size: int,
    hash_block_size: int,
    eagle_drop: bool,
) -> int | None:
    """The earliest added stop strictly inside ``(start, end)``, or ``None``.

    * the exact junction (``request.shared_prefix_boundary``) while it lies inside
      the prompt: past the prompt the manager keeps nothing there, and the wheel's
      block-floored stop already covers a resumed request replaying its outputs;
    * under EAGLE the prompt tail one hash unit down, where the sibling's hit lands.
    """
    if not plan.enabled:
        return None
    # Asked for every prefill chunk: no candidate list, and the cheap window test first.
    stop = exact_junction_stop(request, start, end)
    if plan.lowered_tail:
        prompt = request.num_prompt_tokens
        tail = lowered_tail(prompt, hash_block_size)
        if (
            start < tail < end
            and (stop is None or tail < stop)
            and last_pinned_boundary(request, block_size, eagle_drop) < tail < prompt
        ):
            stop = tail
    return stop


def exact_junction_stop(request: Any, start: int, end: int) -> int | None:
    """The exact junction when it lies strictly inside ``(start, end)`` and inside the prompt, else ``None``.

    The only stop :func:`junction_stop` adds without EAGLE (no lowered tail): callers
    that know the plan has none ask this alone and read no geometry.
    """
    junction = request.shared_prefix_boundary
    return junction if start < junction < end and junction <= request.num_prompt_tokens else None
