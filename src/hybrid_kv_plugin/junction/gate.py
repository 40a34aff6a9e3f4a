"""The one predicate that opens the junction checkpoint, and the positions it adds.

Scheduler and Mamba manager must agree: a chunk that ends at the junction costs
an extra forward pass, which is only worth it when the manager then keeps the
state found there. So the predicate is evaluated once per coordinator
(:func:`junction_plan`) and both sides read the resulting :class:`JunctionPlan`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin._log import log_once

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter


@dataclass(frozen=True)
class JunctionPlan:
    """What the junction checkpoint does on one scheduler.

    ``enabled``: stop at the exact junction and keep its Mamba state.
    ``lowered_tail``: the prompt-tail checkpoint moves one hash unit down, where an
    EAGLE sibling's hit lands after the draft drops its last matched unit.
    ``reason``: why the gate is closed (empty when open).
    """

    enabled: bool
    lowered_tail: bool = False
    reason: str = ""


CLOSED = JunctionPlan(enabled=False, reason="switch off")


def junction_plan(switch: bool, coordinator: Any, adapter: VllmAdapter, *, divergence: bool = False) -> JunctionPlan:
    """Open only where the state cached at the junction can actually serve a sibling.

    * an EAGLE group, unless ``divergence`` (``mamba_divergence_checkpoint``): without
      the draft's one-unit drop a junction on the attention grid of a full-block hit
      still lies inside a Mamba block, which only that option pays a chunk for;
    * partial hash hits: a sub-block state is only reachable by a hash-granular hit;
    * no multi-module MTP re-prefill tail: the coordinator then caches
      ``computed - reprefillable`` tokens, not the chunk end, so the manager would
      key the state at a position the forward pass did not stop at.
    """
    if not switch and not divergence:
        return CLOSED
    option = "mamba_shared_prefix_checkpoint" if switch else "mamba_divergence_checkpoint"
    if not coordinator.eagle_group_ids and not divergence:
        reason = "no EAGLE group"
    elif not coordinator.enable_partial_hash_hits:
        reason = "partial hash hits are disabled (prefix-match unit not finer than the Mamba block)"
    elif adapter.coordinator_reprefillable_tokens(coordinator):
        reason = "multi-module MTP re-prefills a tail"
    else:
        managers = [m for m in coordinator.single_type_managers if getattr(m, "mamba_cache_mode", None) == "align"]
        return JunctionPlan(enabled=True, lowered_tail=any(m.use_eagle for m in managers))
    log_once(
        logging.INFO,
        "hybrid-kv-plugin: %s is on but inactive here: %s",
        option,
        reason,
    )
    return JunctionPlan(enabled=False, reason=reason)


def lowered_tail(num_prompt_tokens: int, hash_block_size: int) -> int:
    """The prompt's last hash boundary, one unit down (0 when that leaves nothing)."""
    return max(num_prompt_tokens // hash_block_size * hash_block_size - hash_block_size, 0)


def replay_boundaries(num_prompt_tokens: int, scheduler_block_size: int, eagle: bool) -> tuple[int, ...]:
    """Positions a later request replaying this prompt resumes at.

    Without EAGLE that is the last prompt token. With EAGLE the full-attention hit
    stops on the scheduler-block grid and then drops one block, so the resume point
    is one block below the grid position of ``N - 1`` (a replay of the same prompt)
    or of ``N`` (a continuation of it).
    """
    if not eagle:
        return (num_prompt_tokens - 1,)
    block = scheduler_block_size
    below = {max(end // block * block - block, 0) for end in (num_prompt_tokens - 1, num_prompt_tokens)}
    return tuple(sorted(below))
