"""Patch ``Scheduler._request_remaining_blocks``: count a request's remaining blocks once per scheduling step.

Why: ``admission_reserves_running_prefills`` holds every waiting or preempted
request's allocation to the free blocks minus what the running prefills still
need, so under ``AsyncScheduler`` each admission attempt sums
``_request_remaining_blocks`` over the in-flight prefills; vLLM's own async-load
reservation sums the same counts at each async load it admits, and the plugin's
fine-grained CPU hits admit more of those (2.3x on 0.29.0). Each count walks the
KV-cache coordinator and every group's manager (about 330 bytecodes on 0.33), and
the same requests are counted again at every admission of the step: measured with
``hybrid-kv bench --async-scheduling``, 0.33.0, 2,015 requests, 31,677 counts
against stock's 18,343, about 4.4 M of the plugin's 8.6 M extra bytecodes.

What it changes, on schedulers with a KV connector (the only ones that admit async
loads, or defer their frees and so reserve the running prefills), with the
plugin's ``async_load_liveness`` switch on (the default; off, the engine runs vLLM's
own count, as the rest of that fix); every other engine is bound past both wrappers:

* ``Scheduler.schedule``: starts an empty record before each step and drops it after;
* ``Scheduler._request_remaining_blocks``: answers from the record when the request
  is in the status and has the computed tokens it had when it was counted in this
  step; otherwise asks the wheel's method and records the answer.

Why the record is exact: both sums run only in the waiting scan, after every
running request's allocation of the step. During the scan a request's count
depends on its token count (fixed until the step's outputs arrive), its computed
tokens and the blocks it holds; its blocks change only when it is allocated
(admitted: its status becomes running or waiting-for-load right after) or when its
load lands or fails (its status and computed tokens change). The record is keyed by
both, and dropped after the step, so no count outlives what it was computed from.
Checked: every count of 2,015-request replays (``plugin`` and the wheel's best
option, both schedulers, all eight wheels: 32 runs, up to 35,373 counts each) equal
to the wheel's own; ``tests/test_remaining_blocks_once_per_step.py`` keeps a
300-request replay per wheel and scheduler. Measured with ``hybrid-kv bench
--bytecodes``, 2,015 requests, ``plugin+divergence`` / stock: 0.33.0 1.0829 ->
0.987 async, 1.0499 -> 0.994 ``Scheduler``; 0.29.0 1.2484 -> 1.128, 1.1716 -> 1.120
(the record also serves vLLM's own sum, which stock pays in full).

Upstream: none needed; it serves the plugin's own admission rule and goes with it
(installed on every wheel 0.26.0-0.33.x, as that rule).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.patching import Fingerprint, Installs, PatchSpec, ReadsFingerprint
from hybrid_kv_plugin.scheduler_kind import keeps_async_loads_live

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler"
# The feature whose admission rule this patch makes cheap (and whose switch turns it off).
FEATURE = "async_load_liveness"
# With admission_reserves_running_prefills: every supported wheel.
INSTALLS = Installs(when=lambda adapter: True, since="0.26.0")
# This step's record lives in the scheduler attribute ``_hybrid_kv_remaining_blocks_this_step``:
# (request, status, computed tokens) -> count. Read and set as a plain attribute (one instruction;
# getattr/setattr with a name constant take five).


def specs(adapter: VllmAdapter) -> list[PatchSpec]:
    """The count and the per-step reset, installed together (with every other patch, or none)."""
    common = dict(
        why="each admission recounts the remaining blocks of every in-flight prefill",
        upstream="none needed (serves admission_reserves_running_prefills)",
        inert_for=lambda _, scheduler: not counts_remaining_blocks(scheduler),
    )
    return [
        PatchSpec(
            name="remaining_blocks_once_per_step.count",
            target=f"{SCHEDULER}._request_remaining_blocks",
            fingerprint=Fingerprint(params=("self", "request"), exact=True),
            build=_wrap_count,
            **common,
        ),
        PatchSpec(
            name="remaining_blocks_once_per_step.reset",
            target=f"{SCHEDULER}.schedule",
            # The stock step must still ask for the async-load reservation (the sum the record serves).
            fingerprint=ReadsFingerprint(
                params=("self", "throttle_prefills"),
                self_reads=frozenset({"_inflight_prefill_reserved_blocks", "kv_cache_manager"}),
                at_least=True,
            ),
            build=_wrap_reset,
            **common,
        ),
    ]


def counts_remaining_blocks(scheduler: Any) -> bool:
    """Whether ``scheduler``'s admissions sum remaining blocks, with the ``async_load_liveness`` switch on.

    Only a scheduler with a KV connector does: it admits async loads, and only it can defer its
    frees, so the running-prefill reservation (``scheduler_kind.reserves_running_prefills``) needs one too.
    """
    return keeps_async_loads_live(scheduler) and getattr(scheduler, "connector", None) is not None


def _wrap_count(original: Any) -> Any:
    @functools.wraps(original)
    def _request_remaining_blocks(self: Any, request: Any) -> int:
        try:
            record = self._hybrid_kv_remaining_blocks_this_step
        except AttributeError:  # before the first step
            record = None
        if record is None:  # asked outside a step
            return original(self, request)
        # One dict probe: the status (an IntEnum, hashed in C) and computed tokens are part of the key.
        key = (request, request.status, request.num_computed_tokens)
        count = record.get(key)
        if count is None:
            count = record[key] = original(self, request)
        return count

    return _request_remaining_blocks


def _wrap_reset(original: Any) -> Any:
    @functools.wraps(original)
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._hybrid_kv_remaining_blocks_this_step = {}
        try:
            if args or kwargs:
                return original(self, *args, **kwargs)
            return original(self)  # a plain call: no argument tuple and dict to build
        finally:
            # Outside a step the wheel's method answers: the record holds only this step's counts.
            self._hybrid_kv_remaining_blocks_this_step = None

    return schedule
