"""Patch ``SimpleCPUOffloadScheduler._prepare_eager_store_specs``: no CPU store of a Mamba block a request handed on.

Why: on 0.26-0.29 vLLM's own SimpleCPU connector stores a request's Mamba
``align`` blocks by walking the block table it accumulated from the scheduler
outputs, a table that only grows. The Mamba manager, though, gives a passed state
block back as the request moves on (its table entry turns null); the block can be
taken by another request before the walk reaches it. The walk then stores that
block under whatever key it carries now: another request's prompt-tail state, kept
in that request's running block, which its next chunk rewrites while the copy is in
flight, so the CPU tier holds other bytes under that key. Found by the byte-checked
soak under ``Scheduler`` (``stock`` seed 6, 0.29.0: q1017's walk reached its Mamba
index 2, block 20, at step 9,832; q1020 held block 20 as its running block, keyed as
its prompt-tail state at 224 tokens, and wrote 11 more tokens into it at step 9,833).

What it changes: before the wheel's walk, an entry it is about to read (between the
request's stored cursor and its confirmed tokens) in a Mamba group is nulled when
its block's key does not end where that entry ends (``(index + 1) * block size``):
a key anywhere else is not this request's state there. The wheel's walk skips null
entries and advances its cursor as before. A passed block still holding the
request's own state (the stock path for Mamba stores) keeps its key where the entry
ends and is stored as before. The plugin's ``HybridSimpleCPUConnector`` never walks
Mamba groups positionally (its states come from the boundary hand-offs).

Upstream: vLLM 0.30.0 stores ``align`` Mamba blocks only from the scheduler's
boundary hand-offs (``has_positionally_stable_blocks``); adapter fact
``simplecpu_scans_mamba_positionally``. Installed on 0.26.0-0.29.x; removed in 0.30.0.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.patching import Installs, PatchSpec, ReadsFingerprint

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = "vllm.v1.simple_kv_offload.manager:SimpleCPUOffloadScheduler._prepare_eager_store_specs"
# What the nulling reads is what the wheel's walk reads for the same entries.
READS = frozenset({"_gpu_block_pool", "_reqs_to_store", "cpu_kv_cache_config", "block_size", "cp_world_size"})
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "vllm_fix"
INSTALLS = Installs(when=lambda adapter: adapter.simplecpu_scans_mamba_positionally, since="0.26.0", removed_in="0.30.0")


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="stock_store_skips_handed_on_mamba",
        target=TARGET,
        fingerprint=ReadsFingerprint(params=("self", "scheduler_output"), exact=True, self_reads=READS, at_least=True),
        build=_wrap,
        why="the stock connector's eager walk stores Mamba blocks its request already handed on to another",
        upstream="vLLM 0.30.0 stores align Mamba blocks only from boundary hand-offs (has_positionally_stable_blocks)",
    )


def mamba_groups(offload: Any, mamba_spec: type) -> list[tuple[int, int]]:
    """(group index, block size as the walk counts it) of each Mamba group the walk reads."""
    groups = offload.cpu_kv_cache_config.kv_cache_groups
    return [
        (g, group.kv_cache_spec.block_size * offload.cp_world_size)
        for g, group in enumerate(groups)
        if isinstance(group.kv_cache_spec, mamba_spec)
    ]


def null_handed_on_entries(offload: Any, groups: list[tuple[int, int]]) -> int:
    """Null the Mamba entries the walk is about to read whose block's key ends elsewhere; how many."""
    pool = offload._gpu_block_pool
    blocks, null_id = pool.blocks, pool.null_block.block_id
    nulled = 0
    for state in offload._reqs_to_store.values():
        if state.finished:
            continue
        request = state.request
        confirmed = request.num_computed_tokens - request.num_output_placeholders
        aligned = confirmed // offload.block_size * offload.block_size
        for g, size in groups:
            ids = state.block_ids[g]
            for index in range(state.num_stored_blocks[g], min(len(ids), aligned // size)):
                block = blocks[ids[index]]
                if block.block_hash is not None and block.block_hash_num_tokens != (index + 1) * size:
                    ids[index] = null_id
                    nulled += 1
    return nulled


def _wrap(original: Any) -> Any:
    # Resolved once at install, not on each step (the patch package imports no vLLM at discovery).
    from vllm.v1.kv_cache_interface import MambaSpec

    @functools.wraps(original)
    def _prepare_eager_store_specs(self: Any, scheduler_output: Any) -> Any:
        if self._gpu_block_pool is not None and self._reqs_to_store:
            groups = mamba_groups(self, MambaSpec)
            if groups:
                null_handed_on_entries(self, groups)
        return original(self, scheduler_output)

    return _prepare_eager_store_specs
