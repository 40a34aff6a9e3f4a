"""Patch ``Scheduler.__init__``: bind ``mamba_output_checkpoint`` to the scheduler's Mamba managers.

Why: the option lives on the scheduler (``hybrid_kv_config``, validated by
``scheduler_plugin_config`` before the stock constructor runs) while the Mamba
managers that act on it are built inside that constructor.

What it changes: after the constructor (the ``scheduler_plugin_config`` wrapper
included) returns, an :class:`~hybrid_kv_plugin.output_checkpoint.OutputCheckpoint`
is set on every ``align`` Mamba manager when the option is on and partial hash
hits are enabled; otherwise nothing. ``AsyncScheduler`` inherits it.

Upstream: none; no vLLM release keeps a Mamba state inside an answer (vLLM issue
#56972, open). Installed on 0.29.0-0.33.x (removed in: none yet).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.output_checkpoint.binding import bind
from hybrid_kv_plugin.patching import Fingerprint, Installs, PatchSpec, then_call

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = "vllm.v1.core.sched.scheduler:Scheduler.__init__"
PARAMS = ("self", "vllm_config", "kv_cache_config", "structured_output_manager", "block_size", "hash_block_size")
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "mamba_output_checkpoint"
INSTALLS = Installs(when=lambda adapter: adapter.output_checkpoint_supported, since="0.29.0")


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="output_checkpoint_bind",
        target=TARGET,
        fingerprint=Fingerprint(params=PARAMS),
        build=lambda original: _wrap(original, adapter),
        why="bind mamba_output_checkpoint to the scheduler's align Mamba managers",
        upstream="none (vLLM issue #56972: decode-phase Mamba states are never stored)",
    )


def _wrap(original: Any, adapter: VllmAdapter) -> Any:
    return then_call(original, lambda scheduler: bind(scheduler, adapter))
