"""Patch ``Scheduler._inflight_prefill_reserved_blocks``: under ``Scheduler``, an async load's reservation counts the block a junction state keeps.

Why: vLLM admits a new async KV load only into the free blocks minus what every
in-flight prefill still needs (``_request_remaining_blocks``, the wheel's
whole-sequence count). A prefill whose remaining prompt ends a chunk at a state the
junction backport adds (the junction, EAGLE's lowered prompt tail, a divergence
point) needs one block more: the next chunk copies that state into a new block
before the kept one is released. The junction manager adds that block to the
admission count only under ``AsyncScheduler`` (junction/manager.py; under
``Scheduler`` a count there would run per request per step, 0.29 bench 1.0963 ->
1.1026). A request admitted with a CPU load cannot be preempted, so without the
block the running prefill preempts itself for ever. Found by the soak: 0.28.0
``Scheduler``, EAGLE, 32-token attention blocks, ``plugin-junction`` seed 3 (q44's
chunk 240..256 needed the block reserved for nobody, q46's load held the rest;
q44 and q46 live from step 630 on).

What it changes: under ``Scheduler`` only (``AsyncScheduler``'s managers already
add the block to each request's count), the reservation adds, per in-flight
prefill and enabled junction manager, the block its remaining prompt owes
(``reservation_owed_blocks``). Runs once per async admission, and only where it can
add something: every other engine is bound past it (``inert_for``, at the end of
the scheduler's constructor, after the junction plan).

Upstream: vLLM PR #53945 brings the junction checkpoint natively (0.30.0, whose
own count is left as it is); first version where the plugin no longer installs
this patch: 0.30.0, with the junction backport.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.adapters.capabilities import Feature
from hybrid_kv_plugin.junction.manager import owes_junction_blocks, reservation_owed_blocks
from hybrid_kv_plugin.patching import Fingerprint, Installs, PatchSpec
from hybrid_kv_plugin.scheduler_kind import outputs_arrive_late

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = "vllm.v1.core.sched.scheduler:Scheduler._inflight_prefill_reserved_blocks"
# The feature this patch serves (adapters.capabilities; doctor groups by it).
FEATURE = "mamba_shared_prefix_checkpoint"
# Wherever the plugin backports the junction checkpoint (its manager is the one that owes the block).
INSTALLS = Installs(
    when=lambda adapter: adapter.installs_backport(Feature.MAMBA_SHARED_PREFIX_CHECKPOINT), since="0.26.0", removed_in="0.30.0"
)


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="junction_reservation",
        target=TARGET,
        # The sum's reads (_inflight_prefills) are checked by async_load_landing_reservation's
        # fingerprint of this target: every wheel installs both, or no patch at all.
        fingerprint=Fingerprint(params=("self",), exact=True),
        build=_wrap,
        why="an async load's reservation misses the block a prefill's junction state keeps; under Scheduler a load can starve it",
        upstream="vLLM PR #53945 (0.30.0)",
        # Bound past for AsyncScheduler engines (their managers' counts hold the block) and for
        # engines without an enabled junction manager: those pay nothing per async admission.
        inert_for=lambda _, scheduler: outputs_arrive_late(scheduler) or not owes_junction_blocks(scheduler.kv_cache_manager),
    )


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def _inflight_prefill_reserved_blocks(self: Any) -> int:
        reserved = original(self)
        return reserved + reservation_owed_blocks(self.kv_cache_manager, self._inflight_prefills)

    return _inflight_prefill_reserved_blocks
