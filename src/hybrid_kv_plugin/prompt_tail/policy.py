"""The Mamba prompt-tail positions of each ``prompt_tail_checkpoint`` value.

Invariant: every position is a multiple of the prefix-match unit, lies in
``(0, N]`` for a prompt of N tokens, and ``replay`` <= ``continuation``. Without
EAGLE block drop: ``replay`` is the last hash boundary <= N-1 (an exact replay
must recompute its last token, so its hit lands there), ``continuation`` the last
one <= N (a longer prompt sharing all N tokens lands there). Under EAGLE block
drop both move one unit down (the drafter drops the last matched unit), except
that from 0.32 (``native_keeps_replay_position``) an exact replay's lookup reaches
the continuation position too, so there ``replay`` and ``both`` keep one state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NATIVE, REPLAY, BOTH = "native", "replay", "both"


@dataclass(frozen=True)
class PromptTailPolicy:
    """``mode`` of one scheduler, with the wheel facts its positions depend on.

    ``native_keeps_replay_position``: the wheel itself keeps the ``replay``
    position (vLLM 0.32+); otherwise it keeps the prompt's last hash boundary
    (0.29-0.31), shifted one unit down under EAGLE block drop when
    ``native_eagle_shift`` (0.30+).
    """

    mode: str
    hash_block_size: int
    eagle_drop: bool = False
    native_keeps_replay_position: bool = False
    native_eagle_shift: bool = False
    # ``mode != NATIVE``, stored: the patched methods read it on every call.
    active: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "active", self.mode != NATIVE)

    def replay_position(self, num_prompt_tokens: int) -> int:
        unit = self.hash_block_size
        if self.eagle_drop and self.native_keeps_replay_position:
            # 0.32+ lookups let an exact replay under EAGLE reach one unit below the prompt's end.
            return max(num_prompt_tokens // unit * unit - unit, 0)
        drop = unit if self.eagle_drop else 0
        return max((num_prompt_tokens - 1) // unit * unit - drop, 0)

    def continuation_position(self, num_prompt_tokens: int) -> int:
        unit = self.hash_block_size
        return max(num_prompt_tokens // unit * unit - (unit if self.eagle_drop else 0), 0)

    def native_position(self, num_prompt_tokens: int) -> int:
        if self.native_keeps_replay_position:
            return self.replay_position(num_prompt_tokens)
        unit = self.hash_block_size
        shift = unit if self.eagle_drop and self.native_eagle_shift else 0
        return max(num_prompt_tokens // unit * unit - shift, 0)

    def kept(self, num_prompt_tokens: int) -> frozenset[int]:
        """The prompt-tail positions whose Mamba state this mode keeps (0 is never a state)."""
        if self.mode == NATIVE:
            positions = {self.native_position(num_prompt_tokens)}
        elif self.mode == REPLAY:
            positions = {self.replay_position(num_prompt_tokens)}
        else:
            positions = {self.replay_position(num_prompt_tokens), self.continuation_position(num_prompt_tokens)}
        return frozenset(p for p in positions if p > 0)

    def dropped(self, num_prompt_tokens: int) -> int | None:
        """The wheel's own prompt-tail position when this mode does not keep it."""
        native = self.native_position(num_prompt_tokens)
        return None if native <= 0 or native in self.kept(num_prompt_tokens) else native

    def chunk_stop(self, num_prompt_tokens: int, start: int, end: int) -> int | None:
        """The earliest kept position strictly inside the chunk ``(start, end)``, if any.

        A state is only written where a chunk ends, so each kept position below the
        prompt end must end a chunk; the prompt end itself always does.
        """
        inside = [p for p in self.kept(num_prompt_tokens) if start < p < end and p < num_prompt_tokens]
        return min(inside, default=None)
