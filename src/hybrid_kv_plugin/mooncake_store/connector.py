"""``HybridMooncakeStoreConnector``: ``HybridSimpleCPUConnector`` with a Mooncake store behind its CPU tier.

Engines that share one ``mooncake_master`` share what each one's CPU tier stored:

- write: each block the CPU tier registers (the wheel's store-completion step, named by
  the adapter) is pinned and handed to the tier's put thread, which copies its bytes out
  of the CPU tensors and writes them under each hash the CPU pool keeps for it (primary
  and secondary, with the token count the pool keeps), then unpins it;
- read: a lookup that the local CPU tier would answer short records every block-hash key
  the wheel's own lookup missed; those keys are fetched on the lookup thread while the
  scheduler is told "not yet" (``None``, vLLM's retry); found blocks are placed in free
  CPU-tier blocks under their hashes, and the wheel's lookup runs again. It ends when a
  lookup misses no key that was not already asked, or at the deadline.
- one round trip for a whole prompt, not one per block: the wheel's lookup stops at its
  first missing attention block, so the first lookup of a request also runs the CPU
  tier's coordinator once more with every missing key answered "present" (a survey: the
  coordinator's search reads the pool and changes nothing; its result is dropped) and
  asks the store for every key that search touched. Measured on the cluster test's
  1,984-token prompt: 65 round trips before, 1 after.

So every hit is the CPU tier's own lookup: the prefix-match unit, the Mamba states at
prompt end and answer end and the outcome counters are the plugin's, on every wheel where
``HybridSimpleCPUConnector`` runs. Requires one worker per engine (the scheduler reaches
the worker's CPU tensors in-process) and the same ``PYTHONHASHSEED`` (or a sha256 prefix
hash) on every engine, since the keys are vLLM's block hashes.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from hybrid_kv_plugin.config import PluginConfigError
from hybrid_kv_plugin.connector.simple_cpu import HybridSimpleCPUConnector
from hybrid_kv_plugin.mooncake_store.options import OPTIONS_KEY, StoreOptions, require_mooncake
from hybrid_kv_plugin.mooncake_store.tier import LookupJob, StoreCounters, StoreTier
from hybrid_kv_plugin.registration import current_adapter

logger = logging.getLogger("hybrid_kv_plugin.mooncake_store")

# The worker role's CPU-tier tensors by engine id, for the scheduler role in the same process.
_CPU_TENSORS: dict[str, dict[str, Any]] = {}


@dataclass
class _Lookup:
    """One waiting request's store lookup across scheduler calls."""

    asked: set[str] = field(default_factory=set)
    job: LookupJob | None = None


class HybridMooncakeStoreConnector(HybridSimpleCPUConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        require_mooncake()  # the refusal at start-up; the client itself runs in its agent process
        options = StoreOptions.from_extra(extra)
        parallel = vllm_config.parallel_config
        if parallel.world_size > 1:
            raise PluginConfigError(
                "HybridMooncakeStoreConnector runs with one worker per engine (tensor/pipeline parallel size 1); "
                f"this engine has {parallel.world_size}"
            )
        # The SimpleCPU part validates its own keys; ours are read above. Restored at once:
        # the worker role builds from the same mapping.
        removed = extra.pop(OPTIONS_KEY)
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
            extra[OPTIONS_KEY] = removed
        self.store_options = options
        self._engine_id = str(vllm_config.kv_transfer_config.engine_id)
        self._lookups: dict[str, _Lookup] = {}
        self._released: list[list[Any]] = []  # pinned block lists the put thread is done with
        self._released_lock = threading.Lock()
        self._row_bytes: int | None = None
        self.store_tier: StoreTier | None = None
        if role != KVConnectorRole.SCHEDULER or self.scheduler_manager is None:
            return
        hook = current_adapter().simplecpu_store_completion_hook
        manager = self.scheduler_manager
        completed = getattr(manager, hook)

        def completion(gpu_block_ids: Any, cpu_block_ids: Any, *args: Any, **kwargs: Any) -> Any:
            result = completed(gpu_block_ids, cpu_block_ids, *args, **kwargs)
            self._offer(list(cpu_block_ids))
            return result

        setattr(manager, hook, completion)  # this instance only; the class is untouched
        self.store_tier = StoreTier(
            lambda: _connect(options),
            _namespace(vllm_config, kv_cache_config),
            lookup_timeout_s=options.lookup_timeout_ms / 1000,
            retry_s=options.retry_s,
            max_queued_puts=options.max_queued_puts,
        )

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: Any) -> None:
        super().register_kv_caches(kv_caches)
        tensors = getattr(self.worker_handler, "cpu_kv_caches", None)
        if tensors:
            _CPU_TENSORS[self._engine_id] = tensors

    # ------------------------------------------------------------------ scheduler side
    def store_counters(self) -> StoreCounters:
        return self.store_tier.counters() if self.store_tier is not None else StoreCounters()

    def _tensors(self) -> dict[str, Any] | None:
        return _CPU_TENSORS.get(self._engine_id)

    def _offer(self, cpu_block_ids: list[int]) -> None:
        tier, tensors = self.store_tier, self._tensors()
        if tier is None or tensors is None or not cpu_block_ids:
            return
        pool = self.scheduler_manager.cpu_block_pool
        blocks, items = [], []
        for block_id in cpu_block_ids:
            block = pool.blocks[block_id]
            if block.block_hash is None:
                continue
            keys = [(tier.key_of(block.block_hash), block.block_hash_num_tokens)]
            keys += [(tier.key_of(h), None) for h in pool.cached_block_hashes_by_block.get(block_id, ())]
            blocks.append(block)
            items.append((keys, _reader(tensors, block_id)))
        if not blocks:
            return
        pool.touch(blocks)  # pinned until the put thread copied the bytes out

        def release() -> None:
            with self._released_lock:
                self._released.append(blocks)

        if not tier.offer(items, release):
            pool.free_blocks(blocks)

    def _unpin_released(self) -> None:
        with self._released_lock:
            released, self._released = self._released, []
        for blocks in released:
            self.scheduler_manager.cpu_block_pool.free_blocks(blocks)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        tier = self.store_tier
        if tier is None:
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        self._unpin_released()
        state = self._lookups.get(request.request_id)
        if state is not None and state.job is not None:
            job = state.job
            if not job.done.is_set():
                if not tier.expired(job):
                    return None, False  # the scheduler asks again next step
                state.job = None
                self._lookups.pop(request.request_id, None)
                return super().get_num_new_matched_tokens(request, num_computed_tokens)
            state.job = None
            self._install(job)
        if self._tensors() is None:
            self._lookups.pop(request.request_id, None)
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        # An unavailable store is still asked below (tier.lookup() answers at once and counts the skip), but
        # without the survey: its keys would only be thrown away, on every lookup while the store is down.
        missed: list[bytes] = []
        cache = self.scheduler_manager.cpu_block_pool.cached_block_hash_to_block
        found_one = cache.get_one_block

        def recording(key: Any) -> Any:
            block = found_one(key)
            if block is None:
                missed.append(key)
            return block

        cache.get_one_block = recording  # this lookup only: instance attribute, removed below
        try:
            result = super().get_num_new_matched_tokens(request, num_computed_tokens)
            if missed and state is None and result[0] is not None and tier.available():
                missed += self._survey(request, num_computed_tokens, found_one)
        finally:
            del cache.get_one_block
        state = state or _Lookup()
        new = [key for key in dict.fromkeys(tier.key_of(k) for k in missed) if key not in state.asked]
        if not new or result[0] is None:
            self._lookups.pop(request.request_id, None)
            return result
        job = tier.lookup(new)
        if job is None:
            self._lookups.pop(request.request_id, None)
            return result
        state.asked.update(new)
        state.job = job
        self._lookups[request.request_id] = state
        # The CPU blocks `result` pinned are released by the wheel when this request is looked up again.
        return None, False

    def _survey(self, request: Any, num_computed_tokens: int, found_one: Any) -> list[Any]:
        """Every key the CPU tier's search would read if each block it asks for were present (in order).

        Runs the same search the wheel's lookup runs (the CPU coordinator over the request's
        block hashes past the local prefix, up to its last prompt token) with a hook that
        answers each miss with a stand-in block. The search only reads the pool; its result
        is dropped. Where anything in it fails, nothing is surveyed (the lookup then goes
        one round trip per block, as without it).
        """
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        manager = self.scheduler_manager
        cache = manager.cpu_block_pool.cached_block_hash_to_block
        keys: list[Any] = []
        stand_in = KVCacheBlock(block_id=0)  # never enters the pool: the search's result is dropped

        def present(key: Any) -> Any:
            block = found_one(key)
            if block is None:
                keys.append(key)
                return stand_in
            return block

        remaining = request.block_hashes[num_computed_tokens // manager.hash_block_size :]
        limit = request.num_tokens - 1 - num_computed_tokens
        if not remaining or limit <= 0:
            return []
        previous = cache.get_one_block  # the caller's recording hook, put back below
        cache.get_one_block = present
        try:
            manager.cpu_coordinator.find_longest_cache_hit(remaining, limit)
        except Exception:  # noqa: BLE001 - a survey is an optimisation; the wheel's own lookup decides
            logger.debug("hybrid-kv-plugin: store lookup survey failed", exc_info=True)
            return []
        finally:
            cache.get_one_block = previous
        return keys

    def _install(self, job: LookupJob) -> None:
        """Place fetched blocks in free CPU-tier blocks under their hashes (evictable, like any cached block)."""
        from vllm.v1.core.kv_cache_utils import BlockHashWithGroupId

        tensors = self._tensors()
        if not job.found or tensors is None:
            return
        pool = self.scheduler_manager.cpu_block_pool
        row_bytes = _row_bytes(tensors)
        installed = 0
        prefix = len(self.store_tier.namespace) + 1
        for key, (num_tokens, payload) in job.found.items():
            block_key = BlockHashWithGroupId(bytes.fromhex(key[prefix:]))
            if len(payload) != row_bytes or pool.cached_block_hash_to_block.get_one_block(block_key) is not None:
                continue  # another layout (never written into this tier), or already here
            if pool.get_num_free_blocks() < 1:
                break
            (block,) = pool.get_new_blocks(1)
            _write_row(tensors, block.block_id, payload)
            pool._insert_block_hash(block_key, block, num_tokens)
            pool.free_blocks([block])
            installed += 1
        self.store_tier.note_installed(installed)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        if self.store_tier is not None:
            self._unpin_released()  # every step, so written blocks are evictable again at once
        return super().build_connector_meta(scheduler_output)

    def reset_cache(self) -> Any:
        if self.store_tier is not None:
            self._unpin_released()  # blocks still being written stay pinned: the reset then refuses, as for stores
        return super().reset_cache()

    def request_finished(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        self._lookups.pop(getattr(request, "request_id", None), None)
        return super().request_finished(request, *args, **kwargs)

    def request_finished_all_groups(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        self._lookups.pop(getattr(request, "request_id", None), None)
        return super().request_finished_all_groups(request, *args, **kwargs)

    def shutdown(self) -> None:
        if self.store_tier is not None:
            self.store_tier.close()
            self.store_tier = None
        _CPU_TENSORS.pop(self._engine_id, None)
        parent = getattr(super(), "shutdown", None)
        if parent is not None:
            parent()


def _connect(options: StoreOptions) -> Any:
    """A store client in a process of its own (:mod:`.agent`), set up; raises where setup fails."""
    from hybrid_kv_plugin.mooncake_store.agent import AgentClient

    return AgentClient((
        options.local_hostname, options.metadata_server, options.global_segment_bytes,
        options.local_buffer_bytes, options.protocol, options.rdma_devices, options.master,
    ))  # fmt: skip


def _namespace(vllm_config: Any, kv_cache_config: Any) -> str:
    """Keys of one model's weights and one block layout: the model, its revision and quantization, the
    dtypes and every group's spec (two engines serving other weights under one name never share bytes)."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    parts = [str(model.model), str(getattr(model, "revision", "")), str(getattr(model, "quantization", "")),
             str(model.dtype), str(getattr(cache, "cache_dtype", "")),
             str(getattr(cache, "mamba_ssm_cache_dtype", ""))]  # fmt: skip
    parts += [repr(group.kv_cache_spec) for group in kv_cache_config.kv_cache_groups]
    return "hkv-" + hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _rows(tensors: dict[str, Any], block_id: int) -> list[Any]:
    import torch

    return [t[block_id].reshape(-1).view(torch.uint8) for t in tensors.values()]


def _row_bytes(tensors: dict[str, Any]) -> int:
    return sum(t[0].numel() * t.element_size() for t in tensors.values())


def _reader(tensors: dict[str, Any], block_id: int) -> Any:
    def read() -> bytes:
        return b"".join(row.numpy().tobytes() for row in _rows(tensors, block_id))

    return read


def _write_row(tensors: dict[str, Any], block_id: int, payload: bytes) -> None:
    import torch

    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    offset = 0
    for row in _rows(tensors, block_id):
        row.copy_(data[offset : offset + row.numel()])
        offset += row.numel()
