"""Patch ``Scheduler.schedule``: keep the waiting scan live after a failed async KV load.

Why: vLLM 0.29 added an admission reservation for async KV loads (upstream #44560):
a new async load is admitted only if it fits into the free blocks minus what every
request in ``Scheduler._inflight_prefills`` still needs. When a load fails and no
loaded token is valid (``kv_load_failure_policy="recompute"``), the scheduler frees
the request's blocks and sends it back to waiting, but leaves it in
``_inflight_prefills``. Its whole prompt then stays reserved - against other loads
and against its own retry. Once that request (now holding no blocks) is at the head
of the first waiting queue and fails ``allocate_slots``, the scan ``break``s, and
every parked load behind it - holding blocks, its transfer finished - is never
promoted: nothing runs again (``running == 0``, requests waiting forever). The
randomized suite found it on every wheel from 0.29.0 to 0.33.0, with the stock
SimpleCPU connector as well as the plugin's (``tests/test_reliability_regressions.py``
keeps one seed per wheel). The ``kv_holding_waiting`` queue of 0.31+ does not help:
the failed request was admitted there and stays at its head after its blocks are freed.

What it changes, before each scheduling step (the original ``schedule`` then runs
unchanged):

1. a request in ``_inflight_prefills`` that holds no KV block in any group loses
   its reservation (it has nothing in flight; a retry that loads again reserves
   anew at admission);
2. under FCFS, the queue the waiting scan reads first (``skipped_waiting`` on 0.29
   and 0.30, ``kv_holding_waiting`` from 0.31) is reordered, stable, so that requests
   holding KV blocks come before requests holding none - the invariant upstream
   #57841 proposes - so a block-less head that cannot allocate strands nobody.

Priority scheduling gets (1) only (its queue is a heap ordered by priority). With
nothing failed and no block-less request ahead of a block holder, both steps are
no-ops. The switch ``additional_config["hybrid_kv"]["async_load_liveness"]`` (default
true) turns this off per engine.

Upstream: reported in vllm#45388 (head-of-line deadlock with offloading connectors);
open fix for the ordering half: vllm#57841. No released wheel up to 0.33.0 has a fix
for the stale reservation. Installed on 0.29.0-0.33.x (every wheel with the
reservation); to be removed from the first wheel whose soak runs stay live without it.
"""

from __future__ import annotations

import functools
import operator
from itertools import compress
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.patching import Installs, PatchSpec, ReadsFingerprint
from hybrid_kv_plugin.request_fields import computed_tokens_of
from hybrid_kv_plugin.scheduler_kind import keeps_async_loads_live

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = "vllm.v1.core.sched.scheduler:Scheduler.schedule"
# Every wheel that reserves blocks for async loads (and so names the queue scanned first).
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "async_load_liveness"
INSTALLS = Installs(when=lambda adapter: adapter.first_waiting_queue_attr is not None, since="0.29.0")


def spec(adapter: VllmAdapter) -> PatchSpec:
    assert adapter.first_waiting_queue_attr is not None
    return PatchSpec(
        name="async_load_liveness",
        target=TARGET,
        # The stock schedule must still read the state this patch edits.
        fingerprint=ReadsFingerprint(
            params=("self", "throttle_prefills"),
            owner_attrs=("_inflight_prefill_reserved_blocks", "_update_waiting_for_remote_kv"),
            self_reads=frozenset({"_inflight_prefills", "policy", adapter.first_waiting_queue_attr}),
            at_least=True,
        ),
        build=lambda original: _wrap(original, adapter),
        # The switch is read once, at the scheduler's start: bound past where it is off.
        inert_for=lambda scheduler, _: not keeps_async_loads_live(scheduler),
        why="a failed async KV load leaves a stale in-flight reservation that deadlocks the waiting scan",
        upstream="vllm#45388 (report), vllm#57841 (open fix for the queue order)",
    )


def _wrap(original: Any, adapter: VllmAdapter) -> Any:
    queue_attr = adapter.first_waiting_queue_attr

    @functools.wraps(original)
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        # The usual step: nothing in flight and at most one request in the first queue,
        # where both steps below are no-ops. (With the switch off the scheduler is bound past this.)
        if self._inflight_prefills or len(getattr(self, queue_attr)) > 1:
            release_stale_reservations(self, adapter)
            put_block_holders_first(self, adapter)
        if args or kwargs:
            return original(self, *args, **kwargs)
        return original(self)  # a plain call: no argument tuple and dict to build

    return schedule


def release_stale_reservations(scheduler: Any, adapter: VllmAdapter) -> None:
    """Drop in-flight reservations of requests that hold no KV block."""
    inflight = scheduler._inflight_prefills
    if not inflight:  # the usual step (runs before every schedule)
        return
    # A request with computed tokens holds their blocks; only a failed load resets them to 0
    # (picked out in C: most in-flight prefills are running chunks).
    unstarted = compress(inflight, map(operator.not_, map(computed_tokens_of, inflight)))
    stale = [r for r in unstarted if not adapter.request_holds_kv_blocks(scheduler, r.request_id)]
    for request in stale:
        inflight.discard(request)


def put_block_holders_first(scheduler: Any, adapter: VllmAdapter) -> bool:
    """Stable-reorder the first-scanned FCFS waiting queue: block holders first. True if reordered."""
    queue = getattr(scheduler, adapter.first_waiting_queue_attr)
    if len(queue) < 2 or scheduler.policy.value != "fcfs":  # a priority queue is a heap
        return False
    requests = list(queue)
    holds = [adapter.request_holds_kv_blocks(scheduler, r.request_id) for r in requests]
    # Already ordered when no holder comes after a non-holder.
    if all(earlier or not later for earlier, later in zip(holds, holds[1:])):
        return False
    ordered = [r for r, h in zip(requests, holds) if h] + [r for r, h in zip(requests, holds) if not h]
    while queue:
        queue.pop_request()
    for request in ordered:
        queue.add_request(request)
    return True
