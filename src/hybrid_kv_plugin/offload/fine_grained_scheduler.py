"""The scheduler side of ``HybridSimpleCPUConnector`` on vLLM 0.29: fine-grained hybrid hits, backported.

vLLM PR #54736 (native from 0.30.0) lets SimpleCPU offload serve prefix hits that
end on a hash boundary inside a Mamba block for hybrid attention + Mamba
``align`` models. Stock 0.29 already publishes what it needs (the Mamba boundary
hand-offs in ``scheduler_output.kv_connector_block_state``) but its SimpleCPU
scheduler ignores them, scans Mamba block tables positionally, and places loads
assuming every group has the same block size; on the hybrid workload this
reconciles most CPU hits to zero.

:class:`FineGrainedOffloadScheduler` subclasses the wheel's
``SimpleCPUOffloadScheduler`` and replaces the parts that differ:

* geometry: per-group block sizes come from the coordinator's managers (DCP only
  scales the groups it shards); lazy offload keeps CPU hits on scheduler blocks;
* lookup/load: a local prefix that is not scheduler-block aligned skips the
  external lookup (one warning); the pending hit remembers that prefix, and each
  group loads ``cdiv(external, group block)`` blocks placed from
  ``local // group block``;
* store: Mamba ``align`` groups are never scanned positionally; their blocks come
  from the boundary hand-offs, each with an admission decision and a counter;
  attention groups are scanned up to the last hash boundary that a lookup can
  land on; the full-attention partial tail is stored once when the request
  finishes, together with the confirmed blocks it had left (pinned when the next
  step sends them, and only if each block still carries the very key objects it
  was queued under);
* completion: the CPU copy becomes findable under the keys its GPU source carried
  when the store was *staged* (registered only now, never stamped beforehand:
  ``BlockPool._insert_block_hash`` silently skips a block that already carries the
  key, which would leave the copy unfindable);
* counters: every hand-off's outcome is counted, cumulatively
  (``boundary_store_stats``) and as growth not yet reported to the metrics
  (``unreported_outcomes``, which the connector takes each step).

The per-block loops read ``KVCacheBlock``'s hash slots (``_block_hash``,
``_block_hash_num_tokens``) directly: on 0.29 the public names are properties, a
Python call per read, and these loops run for every scheduled request each step.
Likewise "is this key cached on CPU" is a membership test on the CPU map's dict
(``BlockHashToBlockMap._cache``, which holds only present keys) rather than a
``get_one_block`` call per candidate block. :meth:`FineGrainedOffloadScheduler.adopt`
checks both exist. Lists built per block (a hit's pinned blocks, a load's sources and
destinations, the blocks a store allocates, touches and frees) go through C iterators
(``map``, ``compress``, ``filterfalse``) rather than comprehensions.

The connector adopts the object the stock connector constructs (see
:meth:`FineGrainedOffloadScheduler.adopt`), so the wheel's own option parsing
and CPU pool sizing stay in charge and nothing in vLLM is patched.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain, compress, filterfalse
from operator import attrgetter, not_
from typing import Any, NamedTuple

from vllm.distributed.kv_events import MEDIUM_CPU, BlockStored
from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_utils import (
    KVCacheBlock,
    get_block_hash,
    get_group_id,
    maybe_convert_block_hash,
)
from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec
from vllm.v1.simple_kv_offload.manager import (
    LoadRequestState,
    SimpleCPUOffloadScheduler,
    StoreRequestState,
    TransferMeta,
)

from hybrid_kv_plugin._log import log_once
from hybrid_kv_plugin.attention_partial_block import (
    attention_tail_boundary,
    carries_key_objects,
    partial_tail_block,
)
from hybrid_kv_plugin.config import PluginConfigError
from hybrid_kv_plugin.offload.stats import BoundaryStoreStats, StoreOutcome

_log = logging.getLogger("vllm.hybrid_kv_plugin")

# A prefix-cache key a CPU copy will be findable under: (hash with group id, the
# prefix length it stands for, or None for a secondary key of the same block).
CacheKey = tuple[Any, "int | None"]


class PendingCpuHit(NamedTuple):
    """A CPU hit pinned between ``get_num_new_matched_tokens`` and ``update_state_after_alloc``."""

    blocks: tuple[list[KVCacheBlock], ...]
    tokens: int
    # The local (GPU) prefix the hit was resolved against: loads are placed after it.
    local_tokens: int


class StagedBlock(NamedTuple):
    """One GPU block chosen for offload, with what its copy will be registered under."""

    gpu_block_id: int
    keys: tuple[CacheKey, ...]
    # Token ids the block covers, kept only for KV events of positional blocks.
    token_ids: tuple[int, ...] = ()


# ``StagedBlock((gpu_block_id, keys, token_ids))`` without the Python-level ``__new__``
# of a NamedTuple (one frame per staged block).
_new_staged_block = functools.partial(tuple.__new__, StagedBlock)
# ScanState.scan_from of a request with no positionally stable group: nothing to scan, ever.
_NEVER = 1 << 62
# The KVCacheBlock slots the per-block loops read (see the module docstring).
HASH_SLOTS = ("_block_hash", "_block_hash_num_tokens")
# Per-block reads done in C (``map``/``filterfalse``): these run for every block a hit,
# a load or a store moves, and a comprehension costs a Python frame plus bytecodes per block.
_IS_NULL = attrgetter("is_null")
_BLOCK_ID = attrgetter("block_id")


def _pinned_blocks(hit_blocks: Iterable[Iterable[KVCacheBlock]]) -> list[KVCacheBlock]:
    """The real blocks of a hit, every group in order (a Mamba group's unneeded states are null)."""
    return list(filterfalse(_IS_NULL, chain.from_iterable(hit_blocks)))


@dataclass
class ScanState(StoreRequestState):
    """The wheel's per-request store state, plus how far the request must compute before the
    per-step scan can confirm another block: below ``scan_from`` computed tokens (output
    placeholders excluded) it stages nothing, so it is not run (most decode steps).
    ``scan_from`` is the least ``(cursor + 1) * block size`` over the positionally stable
    groups after the last scan, or 0 (scan now): the scan's first new block ends there."""

    scan_from: int = 0


class StoreBatch:
    """Blocks staged for one store event; ``cpu_block_ids`` is filled by the allocation.

    Built at least once per step: a slotted class with literal defaults (a dataclass
    with default factories costs five calls per construction).
    """

    __slots__ = ("room", "blocks", "gpu_block_ids", "cpu_block_ids", "req_ids", "keys")

    def __init__(self, room: int = 0) -> None:
        self.room = room  # CPU blocks the batch may take (the pool's free count when it started)
        self.blocks: list[StagedBlock] = []
        # The staged blocks' GPU ids, index-parallel with ``blocks`` (kept, not derived: read every step).
        self.gpu_block_ids: list[int] = []
        self.cpu_block_ids: list[int] = []
        self.req_ids: list[str] = []
        # Primary keys already staged: a second GPU copy of the same content is not stored.
        self.keys: set[Any] = set()

    @property
    def full(self) -> bool:
        return len(self.blocks) >= self.room

    def absorb(self, other: StoreBatch) -> None:
        self.blocks.extend(other.blocks)
        self.gpu_block_ids.extend(other.gpu_block_ids)
        self.cpu_block_ids.extend(other.cpu_block_ids)


class FineGrainedOffloadScheduler(SimpleCPUOffloadScheduler):
    """``SimpleCPUOffloadScheduler`` of vLLM 0.29 with the fine-grained hybrid behaviour of vLLM 0.30."""

    # Attributes this class adds live in slots: the stock scheduler's own attributes nearly
    # fill CPython 3.11's 30 inline ones (29 on 0.29), and past them it falls back to a
    # dictionary whose every read and method call takes the slow path.
    __slots__ = (
        "group_block_sizes",
        "_positional",
        "_positional_groups",
        "_store_unit",
        "_finish_batches",
        "_staged_for_event",
        "_event_blocks",
        "boundary_store_stats",
        "unreported_outcomes",
        "_handoff_keys",
        "partial_tail_filter",
    )

    # ------------------------------------------------------------------ construction
    @classmethod
    def adopt(cls, stock: SimpleCPUOffloadScheduler, adapter: Any) -> FineGrainedOffloadScheduler:
        """An instance of this class holding everything the stock connector's scheduler holds.

        The stock connector constructs its scheduler by a module-level name with
        wheel-specific arguments (capacity, disk tier, lazy mode) and exposes no
        factory; taking over that object's attributes keeps all of that wheel logic,
        allocates the CPU pool once, and patches nothing. The caller replaces its
        reference (nothing else holds the stock object: its constructor hands ``self``
        to no one). A fresh instance rather than ``__class__`` assignment, which on
        CPython 3.11 moves the attributes out of inline storage (slow path for good).
        """
        if not isinstance(stock, SimpleCPUOffloadScheduler):
            raise TypeError(f"cannot adopt {type(stock).__name__}")
        lacking = []
        missing_slots = [name for name in HASH_SLOTS if name not in getattr(KVCacheBlock, "__slots__", ())]
        if missing_slots:
            lacking.append(f"KVCacheBlock slot(s) {', '.join(missing_slots)}")
        if not isinstance(getattr(stock.cpu_block_pool.cached_block_hash_to_block, "_cache", None), dict):
            lacking.append("BlockHashToBlockMap._cache (a dict)")
        if lacking:
            raise PluginConfigError(
                f"hybrid-kv-plugin: the fine-grained SimpleCPU backport reads {' and '.join(lacking)}, "
                f"which vLLM {adapter.version} does not have; set "
                '"fine_grained_hits": false in kv_connector_extra_config to run the stock SimpleCPU connector.'
            )
        fine = cls.__new__(cls)
        for name, value in vars(stock).items():
            setattr(fine, name, value)
        fine._init_fine_grained(adapter)
        return fine

    def _init_fine_grained(self, adapter: Any) -> None:
        coordinator = self.cpu_coordinator
        self.group_block_sizes: tuple[int, ...] = adapter.offload_group_block_sizes(coordinator)
        self.fa_block_size = self.group_block_sizes[self.fa_gidx]
        # Groups whose block table a monotonically advancing cursor can follow.
        self._positional = tuple(adapter.offload_positionally_stable(m) for m in coordinator.single_type_managers)
        self._positional_groups = tuple(g for g, stable in enumerate(self._positional) if stable)
        if self._lazy_mode:
            # Lazy stores never include the boundary hand-offs or the attention
            # partial tail, so a hit inside a Mamba block could not be served whole:
            # keep CPU hits on the scheduler block.
            _scheduler_block_hits_only(coordinator)
            self._target_free = self._lazy_watermark()
        # The finest boundary a lookup can land on, where the store scan stops: with
        # fine-grained hits the hash block (stopping at the scheduler block would drop
        # attention blocks that a Mamba boundary hand-off makes reachable).
        self._store_unit = self.hash_block_size if coordinator.enable_partial_hash_hits else self.block_size
        self._finish_batches: list[StoreBatch] = []
        self._staged_for_event: list[StagedBlock] = []
        self._event_blocks: dict[int, list[StagedBlock]] = {}
        self.boundary_store_stats = BoundaryStoreStats()
        # {outcome label: n} counted since the connector last reported (it swaps in a new dict).
        self.unreported_outcomes: dict[str, int] = {}
        # {key: GPU block} of hand-offs staged; a copy is in flight while its block is.
        self._handoff_keys: dict[Any, int] = {}
        # (request, tail block) -> the block or None: set by the connector's request-end admission
        # (offload/admission.py).
        self.partial_tail_filter: Callable[[Any, KVCacheBlock], KVCacheBlock | None] | None = None

    def _lazy_watermark(self) -> int:
        """GPU blocks the lazy cursor keeps offloaded ahead of eviction, from the resolved group sizes."""
        budget = self.vllm_config.scheduler_config.max_num_batched_tokens
        per_step = 0
        for group, size in zip(self.cpu_kv_cache_config.kv_cache_groups, self.group_block_sizes):
            spec = group.kv_cache_spec
            if isinstance(spec, MambaSpec):
                per_step += 2  # the running state and the one being replaced
            elif isinstance(spec, SlidingWindowSpec):
                per_step += cdiv(spec.sliding_window, size) + 1
            else:
                per_step += cdiv(budget, size)
        return 2 * per_step  # same headroom factor as the stock estimate

    # ------------------------------------------------------------------ lookup and load
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if (stale := self._pending_cpu_hits.pop(request.request_id, None)) is not None:
            self._free_pending_cpu_hit(stale)
        if request.skip_reading_prefix_cache:
            return 0, False
        if num_computed_tokens % self.block_size:
            # Loads copy whole blocks, so an external suffix cannot begin inside a
            # destination block; keep the local hit and skip the CPU tier.
            log_once(
                logging.WARNING,
                "hybrid-kv-plugin: SimpleCPU skips the CPU lookup when the local prefix (%d tokens here) "
                "is not a multiple of the scheduler block size %d",
                num_computed_tokens,
                self.block_size,
            )
            return 0, False
        remaining = request.block_hashes[num_computed_tokens // self.hash_block_size :]
        # The last prompt token is always recomputed (it produces the logits).
        limit = request.num_tokens - 1 - num_computed_tokens
        if not remaining or limit <= 0:
            return 0, False
        blocks, hit_tokens, *_ = self.cpu_coordinator.find_longest_cache_hit(remaining, limit)
        if hit_tokens <= 0:
            return 0, False
        self.cpu_block_pool.touch(_pinned_blocks(blocks))
        self._pending_cpu_hits[request.request_id] = PendingCpuHit(blocks, hit_tokens, num_computed_tokens)
        return hit_tokens, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        req_id = request.request_id
        table = blocks.get_block_ids()
        if not self._lazy_mode and req_id not in self._reqs_to_store:
            self._reqs_to_store[req_id] = ScanState(
                request=request, block_ids=tuple([[] for _ in table]), num_stored_blocks=[0] * len(table)
            )
        pending = self._pending_cpu_hits.pop(req_id, None)
        if num_external_tokens == 0 or pending is None:
            if pending is not None:
                self._free_pending_cpu_hit(pending)
            elif num_external_tokens:
                _log.warning(
                    "hybrid-kv-plugin: request %s was granted %d external tokens without a pending CPU hit; "
                    "nothing is loaded",
                    req_id,
                    num_external_tokens,
                )
            return
        assert pending.local_tokens % self.block_size == 0, "a CPU load must start on a scheduler block"
        assert num_external_tokens % self.hash_block_size == 0, (
            f"{num_external_tokens} external tokens are not a multiple of the hash block {self.hash_block_size}"
        )
        gpu_ids: list[int] = []
        source_ids: list[int] = []  # the CPU blocks loaded, index-parallel with gpu_ids
        # The lookup pinned every hit block. A source keeps its pin as the hold for its
        # load; the others are released (the counts of touching the sources, then
        # releasing every pinned block, without the two passes). 0.29's scheduler grants
        # a hit whole or not at all, so nothing is released here unless a grant is partial.
        released: list[KVCacheBlock] = []
        for g, size in enumerate(self.group_block_sizes):
            # A fine-grained hit may end inside this group's last block: round up.
            wanted = -(-num_external_tokens // size)
            first_slot = pending.local_tokens // size
            group_blocks = pending.blocks[g]
            loaded = group_blocks[:wanted]
            # Null entries (a Mamba state that is not needed, or padding) load nothing.
            real = list(map(not_, map(_IS_NULL, loaded)))
            destinations = table[g][first_slot : first_slot + len(real)]
            assert len(destinations) == len(real), "the allocation must cover every block loaded"
            gpu_ids.extend(compress(destinations, real))
            source_ids.extend(compress(map(_BLOCK_ID, loaded), real))
            if len(group_blocks) > wanted:
                released.extend(filterfalse(_IS_NULL, group_blocks[wanted:]))
        if released:
            self.cpu_block_pool.free_blocks(released)
        gpu_pool = self._gpu_block_pool
        assert gpu_pool is not None
        gpu_pool.touch(list(map(gpu_pool.blocks.__getitem__, gpu_ids)))
        assert req_id not in self._reqs_to_load
        self._reqs_to_load[req_id] = LoadRequestState(
            request=request, transfer_meta=TransferMeta(gpu_ids, source_ids)
        )

    def _free_pending_cpu_hit(self, pending: Any) -> None:
        pinned = _pinned_blocks(pending[0])
        if pinned:
            self.cpu_block_pool.free_blocks(pinned)

    # ------------------------------------------------------------------ choosing what to store
    def _admission(self, block: KVCacheBlock, batch: StoreBatch) -> StoreOutcome:
        """The outcome a store candidate gets; STORED means it may be copied."""
        if block.is_null:
            return StoreOutcome.DROPPED_NULL_BLOCK
        key = block._block_hash
        if key is None:
            return StoreOutcome.DROPPED_NOT_HASHED
        if block.block_id in self._in_flight_store_gpu_blocks:
            return StoreOutcome.SKIPPED_IN_FLIGHT
        if key in batch.keys or key in self.cpu_block_pool.cached_block_hash_to_block._cache:
            return StoreOutcome.SKIPPED_ALREADY_CACHED
        return StoreOutcome.STORED

    def _keys_of(self, block: KVCacheBlock) -> tuple[CacheKey, ...]:
        """Every prefix-cache key the GPU block answers to right now (primary first)."""
        assert self._gpu_block_pool is not None
        secondary = self._gpu_block_pool.cached_block_hashes_by_block.get(block.block_id, ())
        return ((block._block_hash, block._block_hash_num_tokens), *((key, None) for key in secondary))

    def _stage(self, batch: StoreBatch, block: KVCacheBlock, tokens: Sequence[int] = ()) -> None:
        block_id = block.block_id
        assert self._gpu_block_pool is not None
        if block_id in self._gpu_block_pool.cached_block_hashes_by_block:
            keys = self._keys_of(block)
        else:  # the usual case, without secondary keys (spares a call per staged block)
            keys = ((block._block_hash, block._block_hash_num_tokens),)
        batch.blocks.append(_new_staged_block((block_id, keys, tuple(tokens))))
        batch.gpu_block_ids.append(block_id)
        batch.keys.add(keys[0][0])
        # Claim it now, so a second request sharing this block does not stage it again.
        self._in_flight_store_gpu_blocks.add(block_id)

    def _scan_confirmed(
        self, request: Any, table: Sequence[Sequence[int]], cursors: list[int], batch: StoreBatch
    ) -> int:
        """Stage confirmed blocks of the positionally stable groups, advancing ``cursors`` (one per group).

        Returns the computed-token count below which the next scan stages nothing
        (:attr:`ScanState.scan_from`; 0 when it stopped for CPU space). Runs for every
        running request each step, so the admission test of :meth:`_admission` (only
        "may be stored" matters here) and :meth:`_stage` are inlined.
        """
        unit = self._store_unit
        reachable = (request.num_computed_tokens - request.num_output_placeholders) // unit * unit
        scan_from = _NEVER
        for g in self._positional_groups:
            ids = table[g]
            size = self.group_block_sizes[g]
            start = cursors[g]
            stop = min(len(ids), reachable // size)
            if stop <= start:
                # Nothing new here until the block after the cursor is reachable (sizes are unit multiples).
                if (start + 1) * size < scan_from:
                    scan_from = (start + 1) * size
                continue
            pool = self._gpu_block_pool
            assert pool is not None
            gpu_blocks = pool.blocks
            secondary_keys = pool.cached_block_hashes_by_block
            in_flight = self._in_flight_store_gpu_blocks
            cpu_cached = self.cpu_block_pool.cached_block_hash_to_block._cache
            staged_keys = batch.keys
            staged = batch.blocks
            staged_ids = batch.gpu_block_ids
            events = self.enable_kv_cache_events
            room = batch.room - len(staged)  # CPU blocks this batch may still take
            for index, block in enumerate(map(gpu_blocks.__getitem__, ids[start:stop]), start):
                if block.is_null:
                    continue
                key = block._block_hash
                # Cheapest tests first; the usual skip is a block already on the CPU tier.
                if key is None or key in cpu_cached or key in staged_keys:
                    continue
                block_id = block.block_id
                if block_id in in_flight:
                    continue
                if room <= 0:
                    cursors[g] = index
                    return 0  # out of CPU space: retry from here next step
                room -= 1
                if block_id in secondary_keys:
                    keys = self._keys_of(block)
                else:
                    keys = ((key, block._block_hash_num_tokens),)
                tokens = tuple(request.all_token_ids[index * size : (index + 1) * size]) if events else ()
                staged.append(_new_staged_block((block_id, keys, tokens)))
                staged_ids.append(block_id)
                staged_keys.add(key)
                # Claimed now, so a second request sharing this block does not stage it again.
                in_flight.add(block_id)
            cursors[g] = stop
            if (stop + 1) * size < scan_from:
                scan_from = (stop + 1) * size
        return scan_from

    def _take_boundary_handoffs(self, scheduler_output: Any, batch: StoreBatch) -> None:
        """Admit (or count the refusal of) every Mamba boundary hand-off of this step."""
        assert self._gpu_block_pool is not None
        block_state = scheduler_output.kv_connector_block_state
        handoffs = block_state.boundary_state_offloads if block_state is not None else {}
        if not handoffs:
            return
        finished = scheduler_output.finished_req_ids
        preempted = scheduler_output.preempted_req_ids or ()
        gpu_blocks = self._gpu_block_pool.blocks
        in_flight = self._in_flight_store_gpu_blocks
        # Under async scheduling vLLM 0.26-0.31 re-key the prompt tail when the prefill's output
        # arrives a step late and hand off a second copy under the same key, holding a later state.
        staged_keys = self._handoff_keys = {k: b for k, b in self._handoff_keys.items() if b in in_flight}
        counted: dict[str, int] = {}
        for req_id, entries in handoffs.items():
            state = self._reqs_to_store.get(req_id)
            # Hand-offs are not filtered by liveness: a request that is leaving gives its
            # blocks back, and another request may already write them.
            if state is None or state.finished or req_id in finished or req_id in preempted:
                label = StoreOutcome.DROPPED_REQUEST_GONE._value_
                counted[label] = counted.get(label, 0) + len(entries)
                continue
            took_any = False
            for _group, gpu_block_id, _boundary_tokens in entries:
                block = gpu_blocks[gpu_block_id]
                outcome = self._admission(block, batch)
                if outcome is StoreOutcome.STORED and block._block_hash in staged_keys:
                    outcome = StoreOutcome.SKIPPED_IN_FLIGHT  # a copy under this key is on its way
                if outcome is StoreOutcome.STORED:
                    if batch.full:
                        outcome = StoreOutcome.DROPPED_CPU_FULL
                        log_once(
                            logging.WARNING,
                            "hybrid-kv-plugin: SimpleCPU dropped a Mamba boundary hand-off: the CPU pool is full "
                            "(that boundary is not retried)",
                        )
                    else:
                        self._stage(batch, block)
                        staged_keys[block._block_hash] = gpu_block_id
                        took_any = True
                # ``_value_``: the enum's ``value`` property costs a descriptor call per read.
                label = outcome._value_
                counted[label] = counted.get(label, 0) + 1
            if took_any:
                batch.req_ids.append(req_id)
        if counted:
            self._record_outcomes(counted)

    def _record_outcomes(self, counted: dict[str, int]) -> None:
        """Add one step's ``{outcome label: n}`` to the cumulative counters and to the unreported growth."""
        self.boundary_store_stats.add(counted)
        unreported = self.unreported_outcomes
        for label, n in counted.items():
            unreported[label] = unreported.get(label, 0) + n

    def _collect_eager(self, scheduler_output: Any) -> StoreBatch:
        batch = StoreBatch(room=self.cpu_block_pool.get_num_free_blocks())
        if self._gpu_block_pool is None:
            return batch
        self._take_boundary_handoffs(scheduler_output, batch)
        tracked = self._reqs_to_store
        scheduled = scheduler_output.num_scheduled_tokens
        staged = batch.blocks
        for req_id, new_ids, resumed in yield_req_data(scheduler_output):
            state = tracked.get(req_id)
            if state is None or state.finished:
                continue
            table = state.block_ids
            if resumed:  # preempted and rescheduled: the block table starts over
                state.block_ids = table = tuple([[] for _ in table])
                state.num_stored_blocks = [0] * len(table)
                state.scan_from = 0
            if new_ids:
                for row, ids in zip(table, new_ids):
                    if ids:
                        row.extend(ids)
            if not scheduled.get(req_id, 0):
                continue
            request = state.request
            if request.num_computed_tokens - request.num_output_placeholders < state.scan_from:
                continue  # no block of it can be confirmed yet (most decode steps)
            before = len(staged)
            state.scan_from = self._scan_confirmed(request, table, state.num_stored_blocks, batch)
            if len(staged) > before and req_id not in batch.req_ids:
                batch.req_ids.append(req_id)
        return batch

    def _collect_lazy(self) -> StoreBatch:
        """Offload hashed GPU blocks that are next in line for eviction (walks the free queue)."""
        batch = StoreBatch(room=self.cpu_block_pool.get_num_free_blocks())
        pool = self._gpu_block_pool
        if pool is None or self._target_free <= 0:
            return batch
        if self._cursor is not None and self._cursor.ref_cnt > 0:
            self._cursor = None  # the cursor block left the free queue
        last = self._cursor
        for seen, block in enumerate(pool.free_block_queue.iter_blocks_after(self._cursor)):
            if seen >= self._target_free or batch.full:
                break
            last = block
            if not block.is_null and self._admission(block, batch) is StoreOutcome.STORED:
                self._stage(batch, block)
        self._cursor = last
        return batch

    def _allocate(self, batch: StoreBatch) -> StoreBatch:
        """Give every staged block a CPU destination and hold its GPU source until the copy completes."""
        if batch.blocks:
            gpu_pool = self._gpu_block_pool
            assert gpu_pool is not None
            batch.cpu_block_ids = list(map(_BLOCK_ID, self.cpu_block_pool.get_new_blocks(len(batch.blocks))))
            gpu_pool.touch(list(map(gpu_pool.blocks.__getitem__, batch.gpu_block_ids)))
        return batch

    def prepare_store_specs(self, scheduler_output: Any) -> tuple[list[int], list[int], list[str]]:
        finished: list[StoreBatch] = []
        if self._finish_batches:  # most steps have none queued
            # Checked first: a dropped block leaves the in-flight set before this step's scan.
            finished = [self._still_cached(queued) for queued in self._finish_batches]
            self._finish_batches.clear()
        batch = self._allocate(self._collect_lazy() if self._lazy_mode else self._collect_eager(scheduler_output))
        # Stores queued when a request finished ride along with this step's event.
        for queued in finished:
            batch.absorb(self._allocate(self._clipped(queued)))
        self._staged_for_event = batch.blocks
        return batch.gpu_block_ids, batch.cpu_block_ids, batch.req_ids

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)  # calls prepare_store_specs
        staged, self._staged_for_event = self._staged_for_event, []
        if meta.store_event >= 0:
            self._event_blocks[meta.store_event] = staged
        return meta

    # ------------------------------------------------------------------ request finish
    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, Any]:
        self._stage_finish_store(request, block_ids)
        return self.request_finished(request, block_ids=[])

    def _stage_finish_store(self, request: Any, block_ids: Sequence[Sequence[int]]) -> None:
        """Queue the confirmed blocks the per-step scan had not reached, plus the attention partial tail."""
        state = self._reqs_to_store.get(request.request_id)
        if state is None or self._gpu_block_pool is None:
            return
        batch = StoreBatch(room=self.cpu_block_pool.get_num_free_blocks())
        # A scratch copy of the cursors: the request is leaving, its state is not advanced.
        self._scan_confirmed(state.request, block_ids, list(state.num_stored_blocks), batch)
        tail = self._attention_partial_tail(request, block_ids)
        if tail is not None and self.partial_tail_filter is not None:
            tail = self.partial_tail_filter(request, tail)
        # Decode may have filled the tail block, in which case the scan above already
        # staged it (and marked it in flight): never copy one GPU block twice.
        if tail is not None and tail.block_id not in batch.gpu_block_ids and not batch.full:
            self._stage(batch, tail)
        if batch.blocks:
            # Not pinned yet: an idle engine (no next step) must not hold GPU blocks, or
            # reset_prefix_cache() refuses; the next step pins what is still cached.
            self._finish_batches.append(batch)

    def _still_cached(self, batch: StoreBatch) -> StoreBatch:
        """The queued finish stores whose GPU blocks still carry the keys staged (evicted or reset blocks are dropped)."""
        assert self._gpu_block_pool is not None
        gpu_blocks = self._gpu_block_pool.blocks
        kept = StoreBatch()
        for record in batch.blocks:
            if not self._carries(gpu_blocks[record.gpu_block_id], record.keys):
                self._in_flight_store_gpu_blocks.discard(record.gpu_block_id)
                continue
            kept.blocks.append(record)
            kept.gpu_block_ids.append(record.gpu_block_id)
        return kept

    def _carries(self, block: KVCacheBlock, keys: tuple[CacheKey, ...]) -> bool:
        """Whether ``block`` still answers to the very key objects staged in ``keys`` (``_keys_of``),
        for as many tokens: a block handed on and keyed again with equal keys does not."""
        (primary, num_tokens), secondary = keys[0], [key for key, _ in keys[1:]]
        return block.block_hash_num_tokens == num_tokens and carries_key_objects(
            self._gpu_block_pool, block, primary, secondary
        )

    def _clipped(self, batch: StoreBatch) -> StoreBatch:
        """``batch`` cut to the CPU blocks free now (its room was counted at finish, before other allocations)."""
        room = self.cpu_block_pool.get_num_free_blocks()
        for record in batch.blocks[room:]:
            self._in_flight_store_gpu_blocks.discard(record.gpu_block_id)
        del batch.blocks[room:], batch.gpu_block_ids[room:]
        return batch


    def _attention_partial_tail(self, request: Any, block_ids: Sequence[Sequence[int]]) -> KVCacheBlock | None:
        """The full-attention block holding the prompt's last hash boundary (or, with
        ``mamba_output_checkpoint``, the newest kept answer position), when that boundary is inside it.

        The GPU manager registers that boundary as a partial key on the block; the
        positional scan only copies whole blocks, so without this the Mamba group
        holds the boundary and attention does not, and the hybrid lookup drops to
        the previous common boundary.
        """
        if not self.cpu_coordinator.enable_partial_hash_hits:
            return None
        return partial_tail_block(self, request, block_ids, attention_tail_boundary(request, self.hash_block_size))

    # ------------------------------------------------------------------ completion
    def _process_store_event(self, event_idx: int) -> None:
        staged = self._event_blocks.pop(event_idx, None)
        transfer = self._store_event_to_blocks.pop(event_idx, None)
        if transfer is None:
            abandoned = self._abandoned_store_event_to_blocks.pop(event_idx, None)
            if abandoned is not None:  # the CPU cache was reset while it was copying
                self._release_transfer_refs(abandoned)
            return
        self._in_flight_store_gpu_blocks.difference_update(transfer.gpu_block_ids)
        self._publish(transfer, staged or [])
        for req_id in self._store_event_to_reqs.pop(event_idx, []):
            state = self._reqs_to_store.get(req_id)
            if state is None:
                continue
            state.store_events.discard(event_idx)
            if state.finished and not state.store_events:
                self._cleanup_store_request(req_id)

    def _publish(self, transfer: TransferMeta, staged: list[StagedBlock]) -> None:
        """Make the copies findable under their sources' keys, then drop the transfer's references."""
        assert len(staged) == len(transfer.cpu_block_ids) == len(transfer.gpu_block_ids)
        cpu_pool = self.cpu_block_pool
        cpu_blocks = list(map(cpu_pool.blocks.__getitem__, transfer.cpu_block_ids))
        insert = cpu_pool._insert_block_hash
        cache_map = cpu_pool.cached_block_hash_to_block
        cached = cache_map._cache
        events = self.enable_kv_cache_events
        for cpu_block, record in zip(cpu_blocks, staged):
            keys = record.keys
            if len(keys) == 1 and cpu_block._block_hash is None:
                # The usual record, one key, on a block fresh from the free list (no key, in
                # no map entry): what ``_insert_block_hash`` does there, without its checks.
                ((key, cpu_block._block_hash_num_tokens),) = keys
                cpu_block._block_hash = key
                # A key no other copy holds is one dict entry (no map call); else the map merges.
                if cached.setdefault(key, cpu_block) is not cpu_block:
                    cache_map.insert(key, cpu_block)
            else:
                for key, num_tokens in keys:
                    insert(key, cpu_block, num_tokens=num_tokens)
            if events:
                cpu_pool.kv_event_queue.extend(self._stored_events(record))
        cpu_pool.free_blocks(cpu_blocks)  # cached, evictable
        gpu_pool = self._gpu_block_pool
        assert gpu_pool is not None
        gpu_pool.free_blocks(list(map(gpu_pool.blocks.__getitem__, transfer.gpu_block_ids)))

    def _stored_events(self, record: StagedBlock) -> Iterable[BlockStored]:
        for key, num_tokens in record.keys:
            group = get_group_id(key)
            primary = num_tokens is not None
            yield BlockStored(
                block_hashes=[maybe_convert_block_hash(get_block_hash(key))],
                parent_block_hash=None,
                token_ids=list(record.token_ids) if primary else [],
                block_size=self.group_block_sizes[group] if primary else self.hash_block_size,
                lora_id=None,
                medium=MEDIUM_CPU,
                lora_name=None,
                group_idx=group,
            )

    # ------------------------------------------------------------------ housekeeping
    def has_pending_stores(self) -> bool:
        return bool(self._finish_batches) or super().has_pending_stores()

    def reset(self) -> bool:
        for batch in self._finish_batches:  # never pinned nor given CPU blocks
            self._in_flight_store_gpu_blocks.difference_update(batch.gpu_block_ids)
        self._finish_batches.clear()
        done = super().reset()
        # Cumulative counters start over; growth not yet reported still reaches the metrics.
        self.boundary_store_stats = BoundaryStoreStats()
        return done

    def get_boundary_store_stats(self) -> BoundaryStoreStats:
        return self.boundary_store_stats.copy()

    def store_metadata(self, event_idx: int) -> list[StagedBlock] | None:
        """The per-block records of a store event that has not completed (index-parallel with its ids)."""
        return self._event_blocks.get(event_idx)


def _scheduler_block_hits_only(coordinator: Any) -> None:
    """``allow_partial_hash_hits=False`` of vLLM 0.30 for a coordinator that is already built."""
    coordinator.enable_partial_hash_hits = False
    for manager in coordinator.single_type_managers:
        manager.cache_hit_alignment_tokens = coordinator.scheduler_block_size
