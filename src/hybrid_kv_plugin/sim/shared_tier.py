"""One CPU tier shared by several simulated engines: what a Mooncake store shared by all
engines gives, on the SimpleCPU connectors' own scheduler sides.

Each engine keeps its own connector and scheduler-side manager (its request, load and
store bookkeeping, its GPU block pool); :func:`share_cpu_tier` points every manager at
one CPU coordinator and block pool (the tier's index keyed by block hash) and every
byte cache at one CPU tensor. Invariants this keeps:

- a block becomes findable only when the manager that stored it publishes it at its
  store's completion (the wheel's own rule), so another engine never loads bytes that
  are not there yet;
- a block being loaded is pinned in the shared pool, so no engine's store reuses it
  while the copy runs (the byte check's in-flight rule would name it);
- tags are content-derived (:mod:`hybrid_kv_plugin.sim.byte_cache`), so a load by engine
  B of bytes engine A wrote is checked against B's own prefix.

:class:`SourceLedger` records who wrote each published CPU block and, per request, how
many of its loaded tokens lie in attention blocks another engine wrote.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Attributes of a SimpleCPU scheduler-side manager that describe the CPU tier itself.
_TIER_ATTRS = ("cpu_coordinator", "cpu_block_pool", "cpu_kv_cache_config", "num_cpu_blocks")


def share_cpu_tier(engines: Sequence[Any]) -> Any:
    """Make ``engines[1:]`` use ``engines[0]``'s CPU tier (and byte store); returns its pool.

    Every engine must have been built with the same CPU capacity (the shared one), so the
    byte tensors and block ids agree before they are replaced.
    """
    owner = engines[0].offload_manager
    if owner is None:
        raise ValueError("a shared CPU tier needs a SimpleCPU connector on every engine")
    for engine in engines[1:]:
        manager = engine.offload_manager
        if manager is None or manager.num_cpu_blocks != owner.num_cpu_blocks:
            raise ValueError("every engine of a shared tier is built with the same CPU capacity")
        for name in _TIER_ATTRS:
            setattr(manager, name, getattr(owner, name))
        if engine.byte_cache is not None and engines[0].byte_cache is not None:
            engine.byte_cache.cpu = engines[0].byte_cache.cpu
    return owner.cpu_block_pool


class SourceLedger:
    """Who wrote each CPU block, and where each request's loaded tokens came from.

    ``writer[pool id][block id]``: the engine whose store published the block last.
    ``from_other[req_id]``: loaded tokens (of the request's last load) inside
    full-attention blocks another engine wrote. ``unknown`` counts loaded attention
    blocks with no recorded writer (0 unless a block was published unobserved).
    """

    def __init__(self) -> None:
        self.writer: dict[int, dict[int, int]] = {}
        self.from_other: dict[str, int] = {}
        self.unknown = 0
        self.cpu_evictions: dict[int, int] = {}

    def watch(self, index: int, engine: Any) -> None:
        """Wrap, on this engine's manager instance only, its store completion and load set-up.

        The wrappers read; every answer is passed through unchanged.
        """
        manager = engine.offload_manager
        pool = manager.cpu_block_pool
        writers = self.writer.setdefault(id(pool), {})
        process = manager._process_store_event

        def observed_store(event_idx: int) -> Any:
            transfer = manager._store_event_to_blocks.get(event_idx)
            out = process(event_idx)
            if transfer is not None:
                for block_id in transfer.cpu_block_ids:
                    writers[block_id] = index
            return out

        manager._process_store_event = observed_store

        local: dict[str, int] = {}
        lookup = manager.get_num_new_matched_tokens

        def observed_lookup(request: Any, num_computed_tokens: int) -> Any:
            local[request.request_id] = num_computed_tokens
            return lookup(request, num_computed_tokens)

        manager.get_num_new_matched_tokens = observed_lookup

        allocated = manager.update_state_after_alloc

        def observed_alloc(request: Any, blocks: Any, num_external_tokens: int) -> Any:
            out = allocated(request, blocks, num_external_tokens)
            state = manager._reqs_to_load.get(request.request_id)
            if num_external_tokens and state is not None and state.transfer_meta is not None:
                start = local.get(request.request_id, 0)
                self.from_other[request.request_id] = self._tokens_from_other(
                    manager, writers, index, blocks.get_block_ids()[manager.fa_gidx], state.transfer_meta,
                    start, start + num_external_tokens,
                )
            local.pop(request.request_id, None)
            return out

        manager.update_state_after_alloc = observed_alloc

        if id(pool) not in self.cpu_evictions:
            self.cpu_evictions[id(pool)] = 0
            evict = getattr(pool, "_maybe_evict_cached_block", None)
            if evict is not None:
                counts = self.cpu_evictions
                key = id(pool)

                def counted_evict(block: Any) -> Any:
                    evicted = evict(block)
                    if evicted:
                        counts[key] += 1
                    return evicted

                pool._maybe_evict_cached_block = counted_evict

    def _tokens_from_other(
        self, manager: Any, writers: dict[int, int], index: int, table: list[int], transfer: Any, start: int, end: int
    ) -> int:
        """Tokens of ``[start, end)`` held by attention blocks of this load that another engine wrote."""
        size = manager.fa_block_size
        position = {block_id: i for i, block_id in enumerate(table)}
        tokens = 0
        for gpu_id, cpu_id in zip(transfer.gpu_block_ids, transfer.cpu_block_ids):
            i = position.get(gpu_id)
            if i is None:
                continue  # a Mamba state or another group's block (GPU ids are unique across groups)
            writer = writers.get(cpu_id)
            if writer is None:
                self.unknown += 1
                continue
            if writer != index:
                tokens += max(0, min(end, (i + 1) * size) - max(start, i * size))
        return tokens
