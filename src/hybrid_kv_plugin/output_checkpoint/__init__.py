"""``mamba_output_checkpoint``: keep the Mamba state at the end of each answer (multi-turn reuse).

A conversation's next turn is the previous prompt + the previous answer + new text.
In Mamba ``align`` mode no vLLM release keeps a Mamba state inside an answer
between Mamba block ends, so the next turn's hit stops at the last state of the
previous prompt (or at the last Mamba block end the answer crossed). With the
option on, each decode step that ends on a prefix-match-unit boundary keeps the
state there, and drops the one kept before, so a finished request leaves the
state at the last unit boundary of the tokens it computed (prompt + output - 1:
the last sampled token is never fed back).

Pieces:

* :mod:`.binding` - :class:`OutputCheckpoint`, one per scheduler, bound to its
  ``align`` Mamba managers after the scheduler is built;
* :mod:`.rolling` - what one decode boundary does (keep the new state, drop the
  stale one);
* :mod:`hybrid_kv_plugin.attention_partial_block` (shared) - which attention partial block
  the CPU tier stores at finish;
* patches ``output_checkpoint_bind`` (``Scheduler.__init__``),
  ``output_checkpoint_manager`` (``MambaManager._cache_partial_tail_block``) and
  ``output_checkpoint_offload`` (the SimpleCPU scheduler's partial-tail lookup, 0.30+);
  shared with ``prompt_tail_checkpoint``: ``prompt_tail_attention`` (attention keyed at
  a kept position inside a coarser block) and ``prompt_tail_retention`` (a Mamba block
  end kept under retention 0).
"""

from hybrid_kv_plugin.output_checkpoint.binding import MANAGER_ATTR, OutputCheckpoint, bind

__all__ = ["MANAGER_ATTR", "OutputCheckpoint", "bind"]
