"""The exchange clip: per KV-cache group, the block ids a NIXL scheduler may put on the wire.

Both schedulers of a P/D pair must send (P, in ``request_finished``) and
register (D, in ``update_state_after_alloc``) lists that describe the *same*
data, slot for slot, or the worker copies the wrong bytes. What each group's
raw table holds beyond that data:

* sliding window: blocks that fell out of the window (freed only later), so
  only the in-window tail counts;
* Mamba, every cache mode: ``num_speculative_blocks`` trailing scratch slots
  the manager reserves for speculative decoding. They carry stale draft state
  on P and zeros on D, and must never be transferred;
* Mamba, single-state modes (``align`` / ``none``): null placeholders and the
  previous step's superseded state ahead of the running state, so only the
  last non-scratch slot is state;
* Mamba ``all`` mode: one state per block position; the slots stay in order
  and the worker pairs them position-wise (see :mod:`.pairing`).

One exception: the per-step host-buffer save path hands over only the ids a
step *added*, which are not a whole table; stripping "trailing scratch" from
such a partial list would drop real blocks. That path runs inside
:func:`per_step_lists`, where the Mamba strip is off.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from hybrid_kv_plugin.nixl.pairing import pair_ssm_slots

# Positional ("all") is the only Mamba cache mode that keeps one state per block.
POSITIONAL_MODE = "all"

_PER_STEP_LISTS: ContextVar[bool] = ContextVar("hybrid_kv_nixl_per_step_lists", default=False)


@contextmanager
def per_step_lists() -> Iterator[None]:
    """Mark the enclosed clipping as working on one step's added ids (Mamba strip off)."""
    token = _PER_STEP_LISTS.set(True)
    try:
        yield
    finally:
        _PER_STEP_LISTS.reset(token)


def ssm_strip_applies() -> bool:
    return not _PER_STEP_LISTS.get()


@dataclass(frozen=True)
class GroupRule:
    """What to keep of one group's block list.

    ``window_blocks`` > 0 marks a sliding-window group (keep that many tail
    blocks); ``scratch_slots`` is not None for a Mamba group (that many
    trailing speculative slots); ``positional`` for Mamba ``all`` mode.
    """

    window_blocks: int = 0
    scratch_slots: int | None = None
    positional: bool = False

    @property
    def is_ssm(self) -> bool:
        return self.scratch_slots is not None

    def clip(self, blocks: list[int], *, strip_ssm: bool = True) -> list[int]:
        if self.window_blocks:
            return blocks[-self.window_blocks :]
        if not (self.is_ssm and strip_ssm and blocks):
            return blocks
        # The scratch slots are allocated after the state slot, so a list shorter
        # than scratch + 1 lacks scratch, not state. Keeping at least one slot also
        # matters downstream: an empty list reads as "full prefix-cache hit".
        assert self.scratch_slots is not None
        state_end = len(blocks) - min(self.scratch_slots, len(blocks) - 1)
        if self.positional:
            return blocks[:state_end]
        return blocks[state_end - 1 : state_end]


@dataclass(frozen=True)
class ExchangeClip:
    """The rules of every KV-cache group of one engine, in group order."""

    groups: tuple[GroupRule, ...]

    @classmethod
    def from_kv_cache_config(cls, kv_cache_config: Any, window_blocks: Sequence[int] | None = None) -> ExchangeClip:
        """Rules for an engine's ``KVCacheConfig``; ``window_blocks`` as the NIXL scheduler sized them.

        The Mamba cache mode is read from each group's own ``MambaSpec`` (the
        engine copies it there from ``CacheConfig``), so the scheduler and the
        worker of one engine derive identical rules from the same config.
        """
        from vllm.v1.kv_cache_interface import MambaSpec

        groups = kv_cache_config.kv_cache_groups
        windows = list(window_blocks) if window_blocks is not None else [0] * len(groups)
        if len(windows) != len(groups):
            raise ValueError(f"{len(windows)} sliding-window sizes for {len(groups)} KV-cache groups")
        rules = []
        for group, window in zip(groups, windows):
            spec = group.kv_cache_spec
            if isinstance(spec, MambaSpec):
                rules.append(
                    GroupRule(
                        scratch_slots=int(spec.num_speculative_blocks),
                        positional=getattr(spec, "mamba_cache_mode", None) == POSITIONAL_MODE,
                    )
                )
            else:
                rules.append(GroupRule(window_blocks=int(window or 0)))
        return cls(tuple(rules))

    def apply(self, block_ids: Sequence[list[int]], *, strip_ssm: bool = True) -> tuple[list[int], ...]:
        """Every group's list clipped; ``strip_ssm=False`` only trims sliding windows."""
        self._check_arity(block_ids, "block lists")
        return tuple(rule.clip(blocks, strip_ssm=strip_ssm) for rule, blocks in zip(self.groups, block_ids))

    def pair(
        self, decode_ids: Sequence[list[int]], prefill_ids: Sequence[list[int]]
    ) -> tuple[list[list[int]], list[list[int]]]:
        """Pair the Mamba groups of a transfer (other groups are returned untouched)."""
        self._check_arity(decode_ids, "decode block lists")
        self._check_arity(prefill_ids, "prefill block lists")
        decode_out, prefill_out = list(decode_ids), list(prefill_ids)
        for index, rule in enumerate(self.groups):
            if rule.is_ssm:
                decode_out[index], prefill_out[index] = pair_ssm_slots(
                    index, decode_ids[index], prefill_ids[index], positional=rule.positional
                )
        return decode_out, prefill_out

    def _check_arity(self, block_ids: Sequence[Any], what: str) -> None:
        if len(block_ids) != len(self.groups):
            raise ValueError(f"{len(block_ids)} {what} for {len(self.groups)} KV-cache groups")
