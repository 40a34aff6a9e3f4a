"""Correctness invariants of SimpleCPU offload, checked on a :class:`SimEngine` run.

Attach :class:`OffloadInvariants` to an engine before it runs requests; it
observes every ``build_connector_meta`` the real scheduler makes (nothing is
changed) and :meth:`OffloadInvariants.check` asserts, once the engine is idle:

1. **CPU blocks are released**: the CPU pool's free count is back where it
   started (loads and stores drop every reference they took; copies stay cached
   but evictable). The GPU pool must also have no block left referenced.
2. **No GPU block is stored twice**: a (GPU block, content) pair is copied to the
   CPU tier again only if its earlier copy no longer carries that key, and one
   store event never names a GPU block twice.
3. **Copies are published under their source's keys**: when a store event
   completes, each CPU copy answers to the key its GPU source carried when the
   store was issued, and to no key the source did not carry (a copy published
   under a neighbour's key would serve another position's KV or Mamba state).
   vLLM 0.30+ reads the source's keys at completion: a partial key another
   request's hit added to the source meanwhile (a prefix ending inside it, no
   longer than its primary key, the same content) is published too and is
   allowed while the source still carries the primary key it was staged under.
4. **Loads land where their hash says**: every loaded CPU block carries a key of
   the destination's group whose prefix boundary falls inside the destination
   block's token range; for a Mamba state block that boundary is the hit boundary
   itself (the request's computed tokens once the hit is counted), since a state
   is the state after exactly one position.

Violations are collected with their step, so a failure names all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StoreRecord:
    step: int
    gpu_block_id: int
    key: Any
    cpu_block_id: int
    # Every key the GPU source answered to when the store was issued (primary first).
    source_keys: tuple[Any, ...] = ()
    # Prefix tokens the source's primary key covers (off the block grid: a partial key).
    key_tokens: int | None = None


@dataclass
class OffloadInvariants:
    engine: Any
    violations: list[str] = field(default_factory=list)
    stores: list[StoreRecord] = field(default_factory=list)
    # (step, request id, group, destination index, prefix boundary of the matching key)
    loads: list[tuple[int, str, int, int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        manager = self.engine.offload_manager
        if manager is None:
            raise ValueError("the engine has no SimpleCPU scheduler side to watch")
        self.manager = manager
        self.cpu_pool = manager.cpu_block_pool
        self.cpu_free_at_start = self.cpu_pool.get_num_free_blocks()
        self.group_block_sizes = self.engine.adapter.offload_group_block_sizes(manager.cpu_coordinator)
        self.hash_block_size = manager.hash_block_size
        self._copies: dict[tuple[int, Any], StoreRecord] = {}
        # Store event -> its records, until the event completes (or is abandoned).
        self._event_records: dict[int, list[StoreRecord]] = {}
        self.published_checked = 0
        self._mamba_groups = {
            g for g, group in enumerate(self.engine.kv_cache_config.kv_cache_groups) if _is_mamba(group.kv_cache_spec)
        }
        connector = self.engine.connector
        original = connector.build_connector_meta

        def build_connector_meta(scheduler_output: Any) -> Any:
            meta = original(scheduler_output)
            self._observe(meta)
            return meta

        connector.build_connector_meta = build_connector_meta
        original_update = connector.update_connector_output

        def update_connector_output(connector_output: Any) -> Any:
            pending = set(getattr(self.manager, "_store_event_to_blocks", {}))
            result = original_update(connector_output)
            self._observe_completions(pending - set(getattr(self.manager, "_store_event_to_blocks", {})))
            return result

        connector.update_connector_output = update_connector_output

    # ------------------------------------------------------------------ observation
    @property
    def _step(self) -> int:
        return len(self.engine.steps)

    def _keys_of(self, pool: Any, block_id: int) -> list[Any]:
        block = pool.blocks[block_id]
        keys = [block.block_hash] if block.block_hash is not None else []
        return keys + list(pool.cached_block_hashes_by_block.get(block_id, ()))

    def _observe(self, meta: Any) -> None:
        if getattr(meta, "store_event", -1) >= 0:
            self._observe_store(meta)
        if getattr(meta, "load_event", -1) >= 0:
            for req_id in meta.load_event_to_reqs.get(meta.load_event, []):
                state = self.manager._reqs_to_load.get(req_id)
                if state is not None and state.load_event == meta.load_event:
                    self._observe_load(req_id, state)

    def _observe_store(self, meta: Any) -> None:
        gpu_pool = self.engine.gpu_block_pool
        gpu_ids, cpu_ids = list(meta.store_gpu_blocks), list(meta.store_cpu_blocks)
        if len(set(gpu_ids)) != len(gpu_ids):
            self.violations.append(f"step {self._step}: one store event names a GPU block twice: {gpu_ids}")
        records = self._event_records.setdefault(meta.store_event, [])
        for gpu_id, cpu_id in zip(gpu_ids, cpu_ids):
            key = gpu_pool.blocks[gpu_id].block_hash
            earlier = self._copies.get((gpu_id, key))
            if earlier is not None and key is not None:
                if key in self._keys_of(self.cpu_pool, earlier.cpu_block_id) or self._in_flight(earlier):
                    self.violations.append(
                        f"step {self._step}: GPU block {gpu_id} stored again (first at step {earlier.step} "
                        f"into CPU block {earlier.cpu_block_id}, which still holds it)"
                    )
            source = gpu_pool.blocks[gpu_id]
            record = StoreRecord(
                self._step, gpu_id, key, cpu_id, tuple(self._keys_of(gpu_pool, gpu_id)),
                getattr(source, "block_hash_num_tokens", None),
            )
            self._copies[(gpu_id, key)] = record
            self.stores.append(record)
            records.append(record)

    def _observe_completions(self, events: set[int]) -> None:
        """Store events that completed in this ``update_connector_output``: compare published keys."""
        gpu_pool = self.engine.gpu_block_pool
        for event in sorted(events):
            for record in self._event_records.pop(event, []):
                self.published_checked += 1
                published = self._keys_of(self.cpu_pool, record.cpu_block_id)
                foreign = [k for k in published if k not in record.source_keys]
                if foreign and gpu_pool.blocks[record.gpu_block_id].block_hash == record.key:
                    # Keys the unchanged source gained since the store was issued (see 3. above).
                    gained = self._keys_of(gpu_pool, record.gpu_block_id)
                    foreign = [k for k in foreign if k not in gained]
                if record.key not in published or foreign:
                    self.violations.append(
                        f"step {self._step}: CPU block {record.cpu_block_id} (copy of GPU block {record.gpu_block_id}, "
                        f"store event {event}) is published under {published}, its source carried "
                        f"{list(record.source_keys)}"
                    )
        # Events a CPU-cache reset abandoned are never published: forget them.
        live = set(getattr(self.manager, "_store_event_to_blocks", {}))
        for event in [e for e in self._event_records if e not in live]:
            del self._event_records[event]

    def _in_flight(self, record: StoreRecord) -> bool:
        pending = getattr(self.manager, "_store_event_to_blocks", {})
        return any(record.cpu_block_id in t.cpu_block_ids for t in pending.values())

    def _observe_load(self, req_id: str, state: Any) -> None:
        request = state.request
        boundary_of = {h: (i + 1) * self.hash_block_size for i, h in enumerate(request.block_hashes)}
        table = self.engine.scheduler.kv_cache_manager.get_block_ids(req_id)
        where = {block_id: (g, i) for g, ids in enumerate(table) for i, block_id in enumerate(ids)}
        transfer = state.transfer_meta
        for gpu_id, cpu_id in zip(transfer.gpu_block_ids, transfer.cpu_block_ids):
            if gpu_id not in where:
                self.violations.append(f"step {self._step}: {req_id} loads into GPU block {gpu_id}, not in its table")
                continue
            group, index = where[gpu_id]
            size = self.group_block_sizes[group]
            boundaries = [
                boundary_of.get(_hash_part(key))
                for key in self._keys_of(self.cpu_pool, cpu_id)
                if _group_part(key) == group
            ]
            inside = [b for b in boundaries if b is not None and index * size < b <= (index + 1) * size]
            expected = ""
            if group in self._mamba_groups:
                # A Mamba state is the state after one exact position: the hit boundary.
                hit = request.num_computed_tokens
                inside = [b for b in inside if b == hit]
                expected = f", a Mamba state must be the one at the hit boundary {hit}"
            if not inside:
                self.violations.append(
                    f"step {self._step}: {req_id} loads CPU block {cpu_id} into group {group} position {index} "
                    f"(tokens {index * size}..{(index + 1) * size}) but it carries boundaries {boundaries}{expected}"
                )
                continue
            self.loads.append((self._step, req_id, group, index, max(inside)))

    def is_partial_attention_store(self, record: StoreRecord) -> bool:
        """A non-Mamba block copied while its key covers only part of it (a prompt's partial tail)."""
        if record.key is None or record.key_tokens is None:
            return False
        group = _group_part(record.key)
        return group not in self._mamba_groups and record.key_tokens % self.group_block_sizes[group] != 0

    # ------------------------------------------------------------------ verdict
    def check(self, *, gpu_released: bool = True) -> None:
        """Assert all invariants; call when the engine is idle (``run_until_idle`` returned)."""
        problems = list(self.violations)
        free_now = self.cpu_pool.get_num_free_blocks()
        if free_now != self.cpu_free_at_start:
            problems.append(f"CPU pool: {free_now} free blocks, {self.cpu_free_at_start} at start")
        if gpu_released:
            gpu_pool = self.engine.gpu_block_pool
            held = [b.block_id for b in gpu_pool.blocks if b.ref_cnt > 0 and not b.is_null]
            if held:
                problems.append(f"GPU pool: blocks still referenced when idle: {held}")
        assert not problems, "SimpleCPU offload invariants violated:\n  " + "\n  ".join(problems)


def _is_mamba(spec: Any) -> bool:
    from vllm.v1.kv_cache_interface import MambaSpec

    return isinstance(spec, MambaSpec)


def _hash_part(key: Any) -> Any:
    from vllm.v1.core.kv_cache_utils import get_block_hash

    return get_block_hash(key)


def _group_part(key: Any) -> int:
    from vllm.v1.core.kv_cache_utils import get_group_id

    return get_group_id(key)
