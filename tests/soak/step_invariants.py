"""Invariants checked after *every* step of a faulty :class:`SimEngine` run (not only at idle).

:class:`~hybrid_kv_plugin.sim.invariants.OffloadInvariants` checks SimpleCPU offload
once the engine is idle. Under fault injection (late, reordered and failed
transfers, aborts, preemption, cache resets while transfers are in flight) a
bookkeeping slip shows up earlier and is easier to pin to one step, so
:class:`StepInvariants` adds, per step:

1. **Pools are sound** (GPU and CPU): no block's reference count is negative (a
   block freed twice), the free queue holds exactly the unreferenced blocks, once each.
2. **Every reference has an owner**: a block's reference count equals the number
   of request block tables that hold it plus the connector transfers (pending
   hits, loads, stores, stores queued at finish, abandoned ones) that pinned it. A
   surplus is a leak that would only show at idle; a deficit is a block that can be
   reallocated while something still uses it.
3. **A failed load is recomputed**: after the worker reports a load failed, the
   request's computed tokens do not exceed what it had verified locally, and no
   destination block of that load carries a prefix-cache key until the request has
   computed (or successfully loaded) past its position.
4. **Outcome counters add up**: ``published`` equals the sum of the other outcome
   fields of ``get_boundary_store_stats()``; where the connector consumes the Mamba
   boundary hand-offs, every hand-off the scheduler published in a step got exactly
   one outcome.

:meth:`StepInvariants.check_idle` adds what must hold once nothing is in flight:
every GPU block unreferenced, the CPU pool back to its start, and the connector's
per-request and per-transfer tables empty.

Each check appends human-readable violations (with the step) instead of raising,
and counts how many invariant evaluations it made (``checks``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hybrid_kv_plugin.sim.invariants import OffloadInvariants
from hybrid_kv_plugin.sim.wheel import boundary_handoffs, partial_tail_pins

# Scheduler-side tables of SimpleCPU (stock, native or the plugin's backport) that
# must be empty once nothing is in flight; a name a wheel lacks is skipped.
_IDLE_EMPTY_TABLES = (
    "_reqs_to_load",
    "_abandoned_reqs_to_load",
    "_load_event_to_reqs",
    "_pending_cpu_hits",
    "_store_event_to_blocks",
    "_abandoned_store_event_to_blocks",
    "_store_event_to_reqs",
    "_reqs_to_store",
    "_in_flight_store_gpu_blocks",
    "_store_event_pending_counts",
    "_finish_batches",  # the 0.29 backport's stores queued at request finish
    "_pending_finished_stores",  # the same queue in vLLM 0.30+
    "_event_blocks",  # the 0.29 backport's per-event staging records
)
# Stores staged when a request finished and not yet sent: their GPU blocks are pinned only once sent (the 0.29
# backport; patch finish_store_pinning on 0.30+); 0.30+ reserves their CPU blocks at finish.
_FINISH_QUEUES = ("_finish_batches", "_pending_finished_stores")


def audit_pool(pool: Any, name: str) -> list[str]:
    """Reference counts and free queue of one ``BlockPool`` agree with each other."""
    problems = []
    blocks = [b for b in pool.blocks if not b.is_null]
    negative = [b.block_id for b in blocks if b.ref_cnt < 0]
    if negative:
        problems.append(f"{name} pool: blocks freed more often than referenced (ref_cnt < 0): {negative}")
    queued = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    if len(set(queued)) != len(queued):
        twice = sorted(b for b, n in Counter(queued).items() if n > 1)
        problems.append(f"{name} pool: blocks queued as free twice: {twice}")
    unreferenced = {b.block_id for b in blocks if b.ref_cnt == 0}
    if set(queued) != unreferenced:
        problems.append(
            f"{name} pool: free queue {sorted(set(queued) - unreferenced)} referenced, "
            f"{sorted(unreferenced - set(queued))} unreferenced but not free"
        )
    if pool.get_num_free_blocks() != len(queued):
        problems.append(f"{name} pool: counts {pool.get_num_free_blocks()} free blocks, queue holds {len(queued)}")
    return problems


def _ids(transfers: Iterable[Any], side: str) -> list[int]:
    return [block_id for t in transfers for block_id in getattr(t, side)]


def connector_pins(manager: Any) -> tuple[Counter[int], Counter[int]]:
    """(GPU, CPU) references the SimpleCPU scheduler side holds, by block id."""
    loads = [s.transfer_meta for s in (*manager._reqs_to_load.values(), *manager._abandoned_reqs_to_load.values())]
    stores = [*manager._store_event_to_blocks.values(), *manager._abandoned_store_event_to_blocks.values()]
    queued = [batch for queue in _FINISH_QUEUES for batch in getattr(manager, queue, ())]
    gpu = Counter(_ids(loads, "gpu_block_ids") + _ids(stores, "gpu_block_ids"))
    cpu = Counter(_ids(loads, "cpu_block_ids") + _ids(stores, "cpu_block_ids") + _ids(queued, "cpu_block_ids"))
    for pending in manager._pending_cpu_hits.values():
        # (per-group CPU blocks, ...): pinned while the scheduler allocates.
        cpu.update(b.block_id for group in pending[0] for b in group if not b.is_null)
    return gpu, cpu


def table_refs(coordinator: Any) -> Counter[int]:
    """One reference per (request, group, position) holding a real block."""
    refs: Counter[int] = Counter()
    for manager in coordinator.single_type_managers:
        for blocks in manager.req_to_blocks.values():
            refs.update(b.block_id for b in blocks if not b.is_null)
    return refs


class EventAwareOffloadInvariants(OffloadInvariants):
    """``OffloadInvariants`` whose "stored twice" check knows which store event a copy belongs to.

    The base class treats an earlier copy as in flight while *its CPU block id* appears
    in any pending store event, and as present while that CPU block carries the key.
    Once the copy completed and the CPU pool reused its block (for other content, or for
    the same key again after an eviction or a CPU-cache reset), a legitimate re-store of
    the GPU block read as a duplicate. Here a copy is in flight exactly while its own
    store event is pending, and forgotten when its CPU block is written again or its
    event is abandoned by a CPU-cache reset (found with seed 4 on vLLM 0.29.0).
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        self._event_of: dict[int, int] = {}
        self._current_event = -1

    def _observe_store(self, meta: Any) -> None:
        self._current_event = meta.store_event
        # A CPU block this event writes lost whatever copy it held before (evicted, or
        # dropped by a CPU-cache reset); the stock connector stamps the new key on it at
        # once, which must not read as "the earlier copy still holds it".
        reused = set(meta.store_cpu_blocks)
        # A copy whose event a CPU-cache reset abandoned is never published (its CPU block
        # loses the key stamped at allocation once the copy completes): it is gone already.
        abandoned = getattr(self.manager, "_abandoned_store_event_to_blocks", {})
        self._copies = {
            k: r
            for k, r in self._copies.items()
            if r.cpu_block_id not in reused and self._event_of.get(id(r)) not in abandoned
        }
        first = len(self.stores)
        super()._observe_store(meta)
        for record in self.stores[first:]:
            self._event_of[id(record)] = meta.store_event

    def _in_flight(self, record: Any) -> bool:
        event = self._event_of.get(id(record))
        pending = getattr(self.manager, "_store_event_to_blocks", {})
        return event is not None and event != self._current_event and event in pending


@dataclass
class FailedLoad:
    req_id: str
    # (group, index in the group's block table, block id) of each load destination.
    destinations: list[tuple[int, int, int]]


@dataclass
class StepInvariants:
    engine: Any
    violations: list[str] = field(default_factory=list)
    checks: int = 0
    # Stores/loads/hand-offs seen, for the summary.
    handoffs_seen: int = 0
    failed_loads_seen: int = 0

    def __post_init__(self) -> None:
        self.manager = self.engine.offload_manager
        self.offload = EventAwareOffloadInvariants(self.engine) if self.manager is not None else None
        self._reported_offload = 0
        self._failures_seen = 0
        self._watch: list[FailedLoad] = []
        self._verified: dict[str, int] = {}
        self._handoffs_this_step = 0
        self._stats_before = self._stats()
        self.consumes_handoffs = self._consumes_handoffs()
        connector = self.engine.connector
        if connector is not None:
            original = connector.build_connector_meta

            def build_connector_meta(scheduler_output: Any) -> Any:
                entries = boundary_handoffs(self.engine.adapter, scheduler_output)
                self._handoffs_this_step = sum(len(v) for v in entries.values())
                self._remember_verified(scheduler_output)
                return original(scheduler_output)

            connector.build_connector_meta = build_connector_meta

    # ------------------------------------------------------------------ helpers
    @property
    def _step(self) -> int:
        return len(self.engine.steps)

    def _fail(self, message: str) -> None:
        self.violations.append(f"step {self._step}: {message}")

    def _consumes_handoffs(self) -> bool:
        from hybrid_kv_plugin.offload.mode import OffloadMode

        connector = self.engine.connector
        if connector is None or getattr(self.manager, "_lazy_mode", False):
            return False  # lazy offload walks the GPU free queue and never takes hand-offs
        mode = getattr(connector, "offload_mode", None)
        if mode is not None:
            return mode in (OffloadMode.BACKPORT, OffloadMode.NATIVE)
        return bool(self.engine.adapter.has_native_fine_grained_cpu_hits)

    def _stats(self) -> dict[str, int] | None:
        connector = self.engine.connector
        getter = getattr(connector, "get_boundary_store_stats", None)
        if getter is None:
            return None
        stats = getter()
        if stats is None:
            return None
        if dataclasses.is_dataclass(stats):
            return {f.name: int(getattr(stats, f.name)) for f in dataclasses.fields(stats)}
        return {k: int(v) for k, v in vars(stats).items() if isinstance(v, int)}

    def _remember_verified(self, scheduler_output: Any) -> None:
        """Before loads are issued: each loading request's tokens that are not external."""
        if self.manager is None:
            return
        for req_id, state in self.manager._reqs_to_load.items():
            if state.load_event is None:
                external = self.engine.outcomes.get(req_id)
                loaded = external.external_tokens if external is not None else 0
                self._verified[req_id] = max(state.request.num_computed_tokens - loaded, 0)

    # ------------------------------------------------------------------ per step
    def check_step(self) -> None:
        """Call after each ``engine.step()``."""
        scheduler = self.engine.scheduler
        gpu_pool = self.engine.gpu_block_pool
        for problem in audit_pool(gpu_pool, "GPU"):
            self._fail(problem)
        self.checks += 1
        expected_gpu = table_refs(scheduler.kv_cache_manager.coordinator)
        expected_gpu.update(b.block_id for b in partial_tail_pins(self.engine.adapter, scheduler.kv_cache_manager))
        # Under async scheduling with a consumer connector the scheduler defers frees (and the release of
        # copy-on-write sources) until the step that may still read them has completed.
        expected_gpu.update(b.block_id for _, blocks in scheduler.deferred_frees for b in blocks)
        expected_cpu: Counter[int] = Counter()
        if self.manager is not None:
            for problem in audit_pool(self.manager.cpu_block_pool, "CPU"):
                self._fail(problem)
            self.checks += 1
            pinned_gpu, expected_cpu = connector_pins(self.manager)
            expected_gpu += pinned_gpu
        self._compare_refs(gpu_pool, expected_gpu, "GPU")
        if self.manager is not None:
            self._compare_refs(self.manager.cpu_block_pool, expected_cpu, "CPU")
            self._check_failed_loads()
            self._check_counters()
            self._collect_offload_violations()

    def _compare_refs(self, pool: Any, expected: Counter[int], name: str) -> None:
        self.checks += 1
        actual = Counter({b.block_id: b.ref_cnt for b in pool.blocks if not b.is_null and b.ref_cnt})
        if actual != expected:
            ids = sorted(set(actual) | set(expected))
            diff = {i: (actual[i], expected[i]) for i in ids if actual[i] != expected[i]}
            self._fail(f"{name} references without owner or owners without reference {{block: (ref_cnt, owners)}}: {diff}")

    def _check_failed_loads(self) -> None:
        failures = self.engine.transfers.failed_loads
        for _, req_ids, gpu_ids in failures[self._failures_seen :]:
            self._start_watch(req_ids, set(gpu_ids))
        self._failures_seen = len(failures)
        self.checks += 1
        scheduler = self.engine.scheduler
        manager = scheduler.kv_cache_manager
        still = []
        for watch in self._watch:
            request = scheduler.requests.get(watch.req_id)
            table = manager.get_block_ids(watch.req_id) if request is not None else None
            pending = []
            for group, index, block_id in watch.destinations:
                if table is None or index >= len(table[group]) or table[group][index] != block_id:
                    continue  # released (or the request started over): the block is no longer its
                size = self.engine.adapter.offload_group_block_sizes(manager.coordinator)[group]
                if request.num_computed_tokens > index * size:
                    continue  # recomputed or reloaded past this position since the failure
                if gpu_pool_block(self.engine, block_id).block_hash is not None:
                    self._fail(
                        f"{watch.req_id}: GPU block {block_id} (group {group} position {index}) of a failed load "
                        f"is prefix-cached although the request computed only {request.num_computed_tokens} tokens"
                    )
                pending.append((group, index, block_id))
            if pending:
                still.append(FailedLoad(watch.req_id, pending))
        self._watch = still

    def _start_watch(self, req_ids: list[str], gpu_ids: set[int]) -> None:
        scheduler = self.engine.scheduler
        for req_id in req_ids:
            self.failed_loads_seen += 1
            request = scheduler.requests.get(req_id)
            if request is None or request.is_finished():
                continue  # aborted while loading: nothing will be computed from it
            verified = self._verified.pop(req_id, 0)
            if request.num_computed_tokens > verified:
                self._fail(
                    f"{req_id}: after its load failed it counts {request.num_computed_tokens} computed tokens, "
                    f"only {verified} were verified locally"
                )
            table = scheduler.kv_cache_manager.get_block_ids(req_id)
            where = [(g, i, b) for g, ids in enumerate(table) for i, b in enumerate(ids) if b in gpu_ids]
            self._watch.append(FailedLoad(req_id, where))

    def _check_counters(self) -> None:
        stats = self._stats()
        handoffs, self._handoffs_this_step = self._handoffs_this_step, 0
        self.handoffs_seen += handoffs
        if stats is None:
            return
        self.checks += 1
        outcomes = sum(v for k, v in stats.items() if k != "published")
        if stats["published"] != outcomes:
            self._fail(f"boundary-store outcomes do not add up: published {stats['published']}, outcomes {stats}")
        before, self._stats_before = self._stats_before, stats
        if self.consumes_handoffs and before is not None and stats["published"] >= before["published"]:
            grown = stats["published"] - before["published"]
            if grown != handoffs:
                self._fail(f"{handoffs} boundary hand-offs published this step, {grown} outcomes counted")

    def _collect_offload_violations(self) -> None:
        assert self.offload is not None
        self.checks += 1
        new = self.offload.violations[self._reported_offload :]
        self._reported_offload = len(self.offload.violations)
        self.violations.extend(new)

    def stats_reset(self) -> None:
        """The connector's CPU cache was reset: its counters start again from zero."""
        self._stats_before = self._stats()

    # ------------------------------------------------------------------ idle
    def check_idle(self) -> None:
        """Call when ``engine.has_work()`` is False: nothing may stay referenced or tracked."""
        self.checks += 1
        held = [b.block_id for b in self.engine.gpu_block_pool.blocks if b.ref_cnt > 0 and not b.is_null]
        if held:
            self._fail(f"idle, but GPU blocks are still referenced: {held}")
        if self.manager is None:
            return
        self.checks += 1
        assert self.offload is not None
        free = self.manager.cpu_block_pool.get_num_free_blocks()
        if free != self.offload.cpu_free_at_start:
            self._fail(f"idle, but the CPU pool has {free} free blocks ({self.offload.cpu_free_at_start} at start)")
        self.checks += 1
        left = {name: getattr(self.manager, name) for name in _IDLE_EMPTY_TABLES if getattr(self.manager, name, None)}
        if left:
            self._fail(f"idle, but the connector still tracks {left}")
        if self._watch:
            self._fail(f"idle, but failed loads were never resolved: {self._watch}")


def gpu_pool_block(engine: Any, block_id: int) -> Any:
    return engine.gpu_block_pool.blocks[block_id]
