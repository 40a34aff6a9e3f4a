"""Patch ``KVCacheManager.allocate_slots``: with deferred block frees, an admission keeps free what the running prefills still need.

Why: vLLM admits a waiting request when its whole sequence fits into the blocks
free *now* (``scheduler_reserve_full_isl``), request by request; only an async KV
load is also held to the free blocks minus what every request still prefilling
needs (``Scheduler._inflight_prefill_reserved_blocks``). Two requests admitted in
one step can so each fit alone and not together: their first chunks leave fewer
blocks than the first one's next chunk needs, and it preempts the other. Under
``Scheduler`` that preemption frees the blocks at once and the first goes on.
With deferred frees (``Scheduler.defer_block_free``: overlapping batches, as
``AsyncScheduler`` runs, and a KV-consuming connector such as a CPU offload) the
preempted request's blocks come back only a step later: the preemption frees
nothing, the first request preempts itself, and both are admitted the same way
again, for ever. Found by the soak under ``AsyncScheduler`` (0.28.0, ``plugin``,
seeds 4, 24 and 35 of 0-40; seed 24: q934 admitted with 21 of 39 blocks free,
q935 with 22 of 22, then 2 left where q934's next chunk needs 4).

What it changes: for an ``AsyncScheduler`` that defers its frees (and only with the
``async_load_liveness`` switch on, the default; a ``Scheduler`` under pipeline
parallelism defers too, but no test here drives one, so it keeps vLLM's rule), a waiting or preempted request's
allocation is held to the free blocks minus what the *running* prefills still need
(``_request_remaining_blocks`` over the running members of ``_inflight_prefills``) -
the rule vLLM applies to async loads, less the requests that wait themselves (an
async load in flight or landed): they make no progress until admitted, and one that
waits behind the request would hold the queue's head for ever (measured: counting
them stalled 0.28 ``plugin`` seed 4 at step 3,710 with nothing running). A running
prefill always finishes or is preempted, so the later request waits at most for
that. A call that already carries a reservation (an async load's admission) is left
as it is. Every other engine gets the wheel's method bound on its own
``KVCacheManager`` (``inert_for``), so a scheduler that frees at once pays nothing per
call. The scheduler attributes read here are checked by ``async_load_landing_reservation``'s
fingerprint (the same feature: both install, or neither).

Upstream: none yet (vLLM 0.33.0 reserves only for async loads). Installed on every
wheel 0.26.0-0.33.x; to be removed from the first wheel whose soak runs under
``AsyncScheduler`` stay live without it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.patching import Fingerprint, Installs, PatchSpec
from hybrid_kv_plugin.request_fields import requests_in_status
from hybrid_kv_plugin.scheduler_kind import reserving_scheduler_of, reserves_running_prefills

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = "vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots"
# Shared by 0.26-0.33 (0.33 appends skip_zeroing_group_ids); the scheduler passes them by keyword.
PARAMS = (
    "self", "request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks",
    "num_lookahead_tokens", "num_external_computed_tokens", "delay_cache_blocks", "num_encoder_tokens",
    "full_sequence_must_fit", "reserved_blocks",
)
# Positional arguments after (request, num_new_tokens) before ``reserved_blocks``.
RESERVED_BLOCKS_POSITION = PARAMS.index("reserved_blocks") - 3
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "async_load_liveness"
# Every supported wheel defers frees under overlapping batches and reserves for async loads.
INSTALLS = Installs(when=lambda adapter: True, since="0.26.0")


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="admission_reserves_running_prefills",
        target=TARGET,
        fingerprint=Fingerprint(params=PARAMS),
        build=_wrap,
        why="with deferred block frees, two requests admitted together can preempt each other for ever",
        upstream="none yet",
        inert_for=lambda _, scheduler: not reserves_running_prefills(scheduler),
    )


def running_prefills_need(scheduler: Any, running: Any) -> int:
    """Blocks the running requests still prefilling need to hold their whole sequence.

    Runs once per admission attempt; the wheel's own per-request count
    (``_request_remaining_blocks``, the whole-sequence count with the admission cap).
    ``running`` is ``RequestStatus.RUNNING``, an IntEnum, so its ``__eq__`` runs in C.
    """
    prefills = list(scheduler._inflight_prefills)
    # Filtered and counted through C iterators (no generator frame per prefill).
    running_ones = requests_in_status(prefills, running)
    return sum(map(scheduler._request_remaining_blocks, running_ones))


def _wrap(original: Any) -> Any:
    from vllm.v1.request import RequestStatus

    admitting = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    running = RequestStatus.RUNNING

    @functools.wraps(original)
    def allocate_slots(self: Any, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        if (
            request.status in admitting
            and not kwargs.get("reserved_blocks")
            and len(args) <= RESERVED_BLOCKS_POSITION
            and (scheduler := reserving_scheduler_of(self)) is not None
        ):
            kwargs["reserved_blocks"] = running_prefills_need(scheduler, running)
        return original(self, request, num_new_tokens, *args, **kwargs)

    return allocate_slots
