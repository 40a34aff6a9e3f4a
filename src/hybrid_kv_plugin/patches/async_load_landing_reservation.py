"""Patch ``Scheduler._inflight_prefill_reserved_blocks``: an async load that lands inside a Mamba block reserves its copy-on-write blocks.

Why: vLLM admits a new async KV load only if it fits into the free blocks
minus what every request in ``_inflight_prefills`` still needs
(``_request_remaining_blocks``), counted with the request's managers as they stand
while its load is in flight. A
load whose hit ends inside a Mamba ``align`` block (a fine-grained CPU hit: vLLM
0.30+ natively, 0.26-0.29 through the plugin's backport) lands a state the Mamba
manager then keeps where it is (the prompt tail, a divergence point): the next
allocation copies it out first, and the manager counts two more blocks for that
step (the copy and the running state). Counted before the load lands, the need
was 0; a second load admitted meanwhile takes the blocks, and with nothing
running each waits for blocks the other holds: the engine stops making progress.
Found by the soak (attention block = Mamba block = 64, a 10-block GPU pool):
vLLM's own SimpleCPU connector on 0.33.0 (``stock`` with that geometry, seed 18),
the plugin's on 0.29.0 (``plugin-divergence-fa64`` seed 11: reserved 0, then 2
needed with 1 free) and on 0.26.0-0.28.0 (``plugin`` with 64-token attention blocks,
seed 8: a load landed at 176, inside the 128..192 Mamba block, with 1 block free).

What it changes: the reservation (the sum the scheduler asks for when it admits
an async load) counts, for each in-flight request still waiting for its load
(``WAITING_FOR_REMOTE_KVS``) whose computed tokens end inside a block of a Mamba
``align`` group, two more blocks per such group - what the manager will ask for
once the load lands. Every other count is unchanged, so at worst a second load
waits a step longer for blocks. The sum, not each request's count, is wrapped:
the scheduler asks for it once per async admission. Off with the plugin's
``async_load_liveness`` switch, as the rest of the liveness fix.

Upstream: none yet (vLLM 0.33.0 counts the reservation before the load lands);
installed on every wheel 0.26.0-0.33.x (each reserves for async loads); to be removed
from the first wheel whose soak runs stay live without it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.patching import Installs, PatchSpec, ReadsFingerprint
from hybrid_kv_plugin.request_fields import computed_tokens_of, requests_in_status
from hybrid_kv_plugin.scheduler_kind import keeps_async_loads_live

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = "vllm.v1.core.sched.scheduler:Scheduler._inflight_prefill_reserved_blocks"
# The feature this patch serves (the same switch as async_load_liveness).
FEATURE = "async_load_liveness"
# Every supported wheel reserves in-flight prefills' blocks when it admits an async load.
INSTALLS = Installs(when=lambda adapter: True, since="0.26.0")
# Blocks a Mamba align group asks for in the step after a state is kept inside a block: the
# copy-on-write block and the running state's block (vLLM's MambaManager estimate).
LANDING_COPY_BLOCKS = 2


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="async_load_landing_reservation",
        target=TARGET,
        # The stock method must still sum over the in-flight prefills (each one's count is the
        # scheduler's _request_remaining_blocks, read inside a generator the scan does not enter).
        fingerprint=ReadsFingerprint(
            params=("self",),
            exact=True,
            owner_attrs=("_request_remaining_blocks",),
            self_reads=frozenset({"_inflight_prefills"}),
            at_least=True,
        ),
        build=_wrap,
        why="an async load that lands inside a Mamba block needs copy-on-write blocks its reservation did not count",
        upstream="none yet",
    )


def landing_copy_blocks(kv_cache_manager: Any, requests: Any, waiting_for_load: Any) -> int:
    """Blocks the Mamba align groups will ask for once the in-flight loads of ``requests`` land inside their blocks.

    Only requests in status ``waiting_for_load`` count (a load that has landed is counted by
    the wheel's own per-request need). Runs once per async admission over every in-flight
    prefill, most of them running chunks: the loads are picked out and counted in C.
    """
    loads = list(requests_in_status(requests, waiting_for_load))
    if not loads:
        return 0
    computed = list(map(computed_tokens_of, loads))
    extra = 0
    for manager in kv_cache_manager.coordinator.single_type_managers:
        if getattr(manager, "mamba_cache_mode", None) == "align":
            # Loads ending inside a block: those with a non-zero remainder.
            extra += LANDING_COPY_BLOCKS * sum(map(bool, map(manager.block_size.__rmod__, computed)))
    return extra


def _wrap(original: Any) -> Any:
    from vllm.v1.request import RequestStatus

    waiting_for_load = RequestStatus.WAITING_FOR_REMOTE_KVS

    @functools.wraps(original)
    def _inflight_prefill_reserved_blocks(self: Any) -> int:
        reserved = original(self)
        # Read here, not bound past: junction_reservation wraps this patch, and an engine that
        # keeps the outer one runs this one whatever its switch.
        if not keeps_async_loads_live(self):
            return reserved
        return reserved + landing_copy_blocks(self.kv_cache_manager, self._inflight_prefills, waiting_for_load)

    return _inflight_prefill_reserved_blocks
