"""Patch ``Scheduler._mamba_block_aligned_split``: also end a prefill chunk at the junction.

Why: with EAGLE + ``--mamba-cache-mode align`` + a prefix-match unit finer than the
Mamba block, a request that shares a prefix with an earlier one learns the
junction (``request.shared_prefix_boundary``, the full-attention hit after the
draft's one-unit drop) at admission. The stock split of vLLM 0.26-0.29 only stops
at that junction floored to the block grid, so no Mamba state exists where the
next sibling's hit lands and that sibling recomputes from the block below.
Likewise the prompt-tail checkpoint sits one hash unit above where an EAGLE hit
can land (vLLM issue #52371).

What it changes: the stock split still decides the chunk; when the scheduler's
junction plan is open (switch ``mamba_shared_prefix_checkpoint`` on, an EAGLE
group, partial hash hits, no multi-module MTP re-prefill tail - see
:mod:`hybrid_kv_plugin.junction.gate`), the chunk is cut earlier at the exact
junction while it lies inside the prompt, and under EAGLE at the prompt's last
hash boundary minus one unit. The Mamba manager installed by
``junction_coordinator`` keeps the state found at those positions. Plan closed:
the stock result is returned unchanged. ``AsyncScheduler`` inherits the method.

Upstream: vLLM PR #53945 ("Cache the Mamba state at the block-grid position of
EAGLE resume", fixes #52371), flag ``--enable-mamba-fine-grained-prefix-cache``,
renamed ``--enable-mamba-shared-prefix-checkpoint`` in 0.31. First version where
the plugin no longer installs this patch: 0.30.0 (the switch maps onto the native
flag there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.adapters.capabilities import Feature
from hybrid_kv_plugin.chunk_stop import SPLIT_TARGET, stock_split_fingerprint, wrap_split
from hybrid_kv_plugin.junction import exact_junction_stop, junction_stop, plan_of
from hybrid_kv_plugin.junction.coordinator import SCHEDULER_PLAN_ATTR
from hybrid_kv_plugin.patching import Installs, PatchSpec

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = SPLIT_TARGET
# Installed together with ``junction_coordinator``, wherever the junction checkpoint is backported.
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "mamba_shared_prefix_checkpoint"
INSTALLS = Installs(
    when=lambda adapter: adapter.installs_backport(Feature.MAMBA_SHARED_PREFIX_CHECKPOINT), since="0.26.0", removed_in="0.30.0"
)


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="junction_split",
        target=TARGET,
        fingerprint=stock_split_fingerprint(adapter),
        build=lambda original: _wrap(original, adapter),
        why="end a prefill chunk at the exact shared-prefix junction (and the EAGLE prompt tail)",
        upstream="vLLM PR #53945",
        inert_for=lambda scheduler, _: not plan_of(scheduler).enabled,
    )


def _wrap(original: Any, adapter: VllmAdapter) -> Any:
    eagle_drop_attr = adapter.scheduler_eagle_drop_attr

    def stop_at(scheduler: Any, request: Any, start: int, end: int) -> int | None:
        # Bound at the end of the scheduler's constructor (inert_patches): read in place, once per chunk.
        plan = scheduler.__dict__.get(SCHEDULER_PLAN_ATTR) or plan_of(scheduler)
        if not plan.enabled:
            return None
        if not plan.lowered_tail:  # without EAGLE: the junction alone, no geometry read (every prefill chunk)
            return exact_junction_stop(request, start, end)
        return junction_stop(
            plan,
            request,
            start,
            end,
            block_size=scheduler.cache_config.block_size,
            hash_block_size=scheduler.hash_block_size,
            eagle_drop=getattr(scheduler, eagle_drop_attr),
        )

    return wrap_split(original, stop_at)
