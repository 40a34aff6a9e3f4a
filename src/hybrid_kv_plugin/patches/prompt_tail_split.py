"""Patch ``Scheduler._mamba_block_aligned_split``: end a prefill chunk at each kept prompt-tail position.

Why: in Mamba ``align`` mode a reusable state exists only where a chunk ended. A
prompt computed in one chunk leaves one state, at its end N, which an exact replay
(it must recompute its last token) cannot use. ``prompt_tail_checkpoint`` =
``replay`` / ``both`` keep the state at the last hash boundary <= N-1 (and, for
``both``, at N too), so that boundary must end a chunk.

What it changes: the wheel's split still decides the chunk (every stop it makes
is kept); when the scheduler's policy (:mod:`hybrid_kv_plugin.prompt_tail`) keeps
a position strictly inside the chunk and below the prompt end, the chunk is cut
there - one extra prefill step per request. Policy ``native``: the wheel's result
is returned unchanged. It needs no model-runner change: the runner writes the
state at every chunk end into the block of the chunk's last token
(``vllm/v1/worker/mamba_utils.py``, 0.29-0.33), and the Mamba manager keeps it
(``prompt_tail_manager``). Backends that export the checkpoint inside the final
chunk (``num_prefill_checkpoint_blocks`` > 0) are left to the wheel on 0.30+.
``AsyncScheduler`` inherits the method. On 0.29 this wraps the ``junction_split``
patch of the same method.

Upstream: vLLM 0.32 moved the single prompt-tail stop to the last hash boundary
<= N-1 (``get_mamba_prefill_checkpoint_position``); no vLLM release keeps both
positions, so the plugin installs this patch on every wheel 0.29.0-0.33.x
(removed in: none yet).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.chunk_stop import SPLIT_PARAMS, SPLIT_TARGET, wrap_split
from hybrid_kv_plugin.patching import Fingerprint, Installs, PatchSpec
from hybrid_kv_plugin.prompt_tail.binding import policy_of

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET, PARAMS = SPLIT_TARGET, SPLIT_PARAMS
# Every wheel whose Mamba manager can keep a partial prompt-tail state (the value is then
# validated and offered); installed after ``junction_split``, which it wraps on 0.29.
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "prompt_tail_checkpoint"
INSTALLS = Installs(when=lambda adapter: adapter.prompt_tail_checkpoint_supported, since="0.29.0")


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="prompt_tail_split",
        target=TARGET,
        fingerprint=Fingerprint(params=PARAMS, exact=True),
        build=lambda original: _wrap(original, adapter),
        why="end a prefill chunk at each prompt-tail position prompt_tail_checkpoint keeps",
        upstream="none (vLLM 0.32 keeps one prompt-tail position, at <= N-1)",
        inert_for=lambda scheduler, _: not policy_of(scheduler, adapter).active,
    )


def _wrap(original: Any, adapter: VllmAdapter) -> Any:
    def stop_at(scheduler: Any, request: Any, start: int, end: int) -> int | None:
        policy = policy_of(scheduler, adapter)
        return policy.chunk_stop(request.num_prompt_tokens, start, end) if policy.active else None

    return wrap_split(original, stop_at)
