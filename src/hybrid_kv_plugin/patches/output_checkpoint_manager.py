"""Patch ``MambaManager._cache_partial_tail_block``: keep the Mamba state at each answer's last unit boundary.

Why: in ``align`` mode the wheel caches, during decode, only Mamba block ends;
a later turn that repeats the answer loses everything after the last one (vLLM
issue #56972). ``mamba_output_checkpoint`` keeps the state at the newest
prefix-match-unit boundary the decode has computed.

What it changes: for a Mamba manager bound by ``output_checkpoint_bind``, when
the tokens being cached (``cache_blocks`` runs at schedule time for what the step
will compute) end past the prompt on a unit boundary the option keeps
(:meth:`~hybrid_kv_plugin.output_checkpoint.OutputCheckpoint.keeps`: one attention can
reach, where ``prompt_tail_attention`` keys a coarser full-attention block) and that
is not a Mamba block end, the state there is registered as the wheel registers its
own partial prompt tail (:mod:`hybrid_kv_plugin.output_checkpoint.rolling`; a Mamba
block end is hashed by the wheel, or under sparse retention through
``prompt_tail_retention``), and the request's older
kept answer states leave the prefix cache (at most one is held per running
request, two under EAGLE block drop, which also needs the state one unit lower).
Every other call runs the wrapped method (the ``prompt_tail_manager`` patch, then
the stock one) unchanged; unbound managers are untouched.

Worker behaviour it relies on (0.29-0.33, ``vllm/v1/worker/mamba_utils.py`` and
the GPU model runner): the runner writes a request's Mamba state after every
forward pass into the block of its last computed token, and runs the scheduler's
queued block copies (``kv_cache_block_copies`` of the scheduler output) before
the next forward pass. So the state after a decode step ending at ``p`` is in
block ``p // block_size`` until the next step, whose allocation queues the
copy-on-write into a fresh block that keeps the key; the scheduler frees that
copy's retention once the step ran. No worker patch is needed.
Under ``AsyncScheduler`` the boundary is cached a step late, while the step whose
forward overwrites block ``p // block_size`` is being allocated: the state is
copied into a fresh block in that step's copies, which the runner runs before that
forward (:func:`hybrid_kv_plugin.output_checkpoint.rolling.late_boundary`).

Upstream: none (vLLM issue #56972, open); installed on 0.29.0-0.33.x. On vLLM
0.26-0.28 the Mamba boundary hand-offs come from the plugin's own channel
(``mamba_boundary_handoffs``, different bookkeeping), not covered yet: the option
is refused there at start-up.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.output_checkpoint.binding import MANAGER_ATTR, output_checkpoint_requested
from hybrid_kv_plugin.output_checkpoint.rolling import at_output_boundary, note_copies
from hybrid_kv_plugin.patching import Installs, PatchSpec, ReadsFingerprint
from hybrid_kv_plugin.patches.prompt_tail_manager import PARAMS, TARGET
from hybrid_kv_plugin.mamba_partial_state import KEEP_PARTIAL_STATE_READS

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

# TARGET, PARAMS: the same method as prompt_tail_manager (installed after it, so it wraps it).
# The rolling keep goes through keep_partial_state.
READS = KEEP_PARTIAL_STATE_READS
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "mamba_output_checkpoint"
INSTALLS = Installs(when=lambda adapter: adapter.output_checkpoint_supported, since="0.29.0")


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="output_checkpoint_manager",
        target=TARGET,
        fingerprint=ReadsFingerprint(params=PARAMS, self_reads=READS, at_least=True),
        build=lambda original: _wrap(original, adapter),
        why="keep the Mamba state at the last prefix-match-unit boundary of each answer",
        upstream="none (vLLM issue #56972: decode-phase Mamba states are never stored)",
        inert_for=lambda _, scheduler: not output_checkpoint_requested(scheduler),
    )


def _wrap(original: Any, adapter: VllmAdapter) -> Any:
    holds_block = adapter.mamba_partial_tail_producer_holds_block

    @functools.wraps(original)
    def _cache_partial_tail_block(self: Any, request: Any, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
        checkpoint = getattr(self, MANAGER_ATTR, None)
        if args or kwargs:
            key = original(self, request, num_tokens, *args, **kwargs)
        else:  # the usual call passes nothing more: a plain call, without argument packing
            key = original(self, request, num_tokens)
        if checkpoint is None or num_tokens <= request.num_prompt_tokens:
            return key
        note_copies(self, request)
        if (
            key is not None
            or not checkpoint.keeps(num_tokens, request.num_prompt_tokens)
            or adapter.mamba_exports_checkpoint(self, request.request_id)
        ):
            return key
        return at_output_boundary(self, request, num_tokens, checkpoint, holds_block)

    return _cache_partial_tail_block
