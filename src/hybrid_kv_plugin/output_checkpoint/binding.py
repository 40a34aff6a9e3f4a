"""One :class:`OutputCheckpoint` per scheduler, handed to its ``align`` Mamba managers
and to its full-attention managers whose block is coarser than the kept positions' step.

Bound once the stock scheduler constructor has built the managers; managers never
bound (option off, a connector's CPU-side coordinator) keep the wheel's behaviour.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin._log import log_once
from hybrid_kv_plugin.attention_partial_block import keyable_inside_blocks
from hybrid_kv_plugin.scheduler_kind import outputs_arrive_late

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

MANAGER_ATTR = "hybrid_kv_output_checkpoint"


@dataclass(frozen=True)
class OutputCheckpoint:
    """``hash_block_size``: the prefix-match unit; ``step``: the positions a hybrid hit can end at
    inside an answer (multiples of the unit and of the block size of every group that cannot be
    keyed inside a block). ``attention_block_sizes``: the full-attention groups, keyed at each kept
    position inside their block (``prompt_tail_attention``). ``eagle_drop``: the lookup drops the
    last matched step (EAGLE block drop), so the state one step below the last boundary is kept too.
    ``late_outputs``: the scheduler is vLLM's ``AsyncScheduler``: a step's sampled token arrives
    after the next step is scheduled, so a boundary's hash is known only once the forward that
    overwrites its state is already scheduled (see :mod:`.rolling`). ``speculative``: the
    scheduler runs draft tokens (under ``late_outputs`` no answer state is kept then)."""

    hash_block_size: int
    step: int
    attention_block_sizes: tuple[int, ...] = ()
    eagle_drop: bool = False
    late_outputs: bool = False
    speculative: bool = False

    def keeps(self, position: int, num_prompt_tokens: int) -> bool:
        """Whether the answer state at ``position`` is kept (and the attention keyed there).

        A block holds one partial key, and a longer one replaces it: an attention block
        that also holds a prompt unit boundary (where the prompt tail may be keyed) is
        keyed only at its end, so the prompt's own reach stays.
        """
        if position <= num_prompt_tokens or position % self.step:
            return False
        prompt_edge = num_prompt_tokens // self.hash_block_size * self.hash_block_size
        return all(position % size == 0 or position // size * size >= prompt_edge
                   for size in self.attention_block_sizes)

    def keep_from(self, boundary: int) -> int:
        """Kept output states below this position are stale once ``boundary`` is computed."""
        return boundary - (self.step if self.eagle_drop else 0)

    @property
    def max_states(self) -> int:
        """Extra Mamba blocks one running request can hold for its answer."""
        return 2 if self.eagle_drop else 1


def output_checkpoint_requested(scheduler: Any) -> bool:
    """The scheduler's ``mamba_output_checkpoint`` option (its managers are bound only when it is on)."""
    return bool(getattr(getattr(scheduler, "hybrid_kv_config", None), "mamba_output_checkpoint", False))


def bind(scheduler: Any, adapter: VllmAdapter) -> OutputCheckpoint | None:
    """Bind the scheduler's option to its ``align`` Mamba managers; None when it stays off."""
    if not output_checkpoint_requested(scheduler):
        return None
    coordinator = scheduler.kv_cache_manager.coordinator
    if not getattr(coordinator, "enable_partial_hash_hits", False):
        # Without partial hash hits every reachable state is a Mamba block end, which the
        # wheel keeps itself during decode.
        log_once(
            logging.INFO,
            "hybrid-kv-plugin: mamba_output_checkpoint is inactive here: partial hash hits are "
            "disabled (prefix-match unit not finer than the Mamba block)",
        )
        return None
    step = scheduler.hash_block_size
    attention: list[Any] = []
    for manager in coordinator.single_type_managers:
        if keyable_inside_blocks(manager):
            attention.append(manager)
        elif getattr(manager, "mamba_cache_mode", None) is None:
            step = math.lcm(step, manager.block_size)
    checkpoint = OutputCheckpoint(
        hash_block_size=scheduler.hash_block_size,
        step=step,
        attention_block_sizes=tuple(sorted({m.block_size for m in attention if step % m.block_size})),
        eagle_drop=bool(getattr(scheduler, adapter.scheduler_eagle_drop_attr, False)),
        late_outputs=outputs_arrive_late(scheduler),
        speculative=bool(getattr(scheduler, "num_spec_tokens", 0)),
    )
    for manager in coordinator.single_type_managers:
        if getattr(manager, "mamba_cache_mode", None) == "align" or (
            manager in attention and step % manager.block_size
        ):
            setattr(manager, MANAGER_ATTR, checkpoint)
    return checkpoint
