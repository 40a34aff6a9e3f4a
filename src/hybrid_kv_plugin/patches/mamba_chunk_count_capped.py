"""Patch ``MambaManager.get_num_blocks_to_allocate``: a chunk is counted no more blocks than it gets.

Why: on 0.26-0.30 the ``align`` Mamba manager replaces its count of a chunk's new
blocks by the most a chunk can ever take (the running state, a copy-on-write, the
prefill checkpoint) whenever any block is new. A running request that already
holds every block its next chunk needs, and only owes the copy of a state kept
inside its running block (``_partial_hit_reqs``: a prompt tail, a divergence
point, a landed load), gets one new block - the copy - yet is counted two or
three. With the pool nearly full the scheduler preempts it for blocks it would
never take; under ``AsyncScheduler`` (which frees a passed state a step later) two
such requests resumed together preempt each other at the same chunk for ever
(soak ``plugin-divergence-fa64``, 0.29.0, async: seeds 0, 2, 7 and 9 stalled, the
divergence states make such resumes common; docs/reliability.md).

What it changes: for a call with no new prefix hit and no speculative blocks (a
running or resumed request's next chunk), the count is capped at what the
allocation can take: the blocks the chunk still lacks, plus the copy the request
owes. The wheel's method runs first and unchanged (it records the chunk's
checkpoint); calls with a new hit or speculative blocks keep its count. The cap
never undercounts: the allocation takes the blocks still lacking after the
request's block list has grown (placeholders, loaded blocks), plus that copy.
Only for the Mamba managers of an ``AsyncScheduler`` (``scheduler_kind``): under
``Scheduler`` a preemption frees its blocks at once, so the over-count only delays
a chunk, and bound past the cap its count costs nothing per step there. (With the cap
also under ``Scheduler`` the sync soak once reached a CPU store of a block being
rewritten, ``stock`` seed 4 on 0.29: the stock connector's walk of a block handed on,
fixed by ``stock_store_skips_handed_on_mamba``.)
Managers that get bindings (0.30; the junction's on 0.26-0.29) call past it there.

Upstream: vLLM 0.31.0 counts a chunk's new blocks no higher than it allocates
(``physical_block_cap`` in the same method); adapter fact
``mamba_chunk_count_capped``. Installed on 0.26.0-0.30.x; removed in 0.31.0.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.patching import Installs, PatchSpec, ReadsFingerprint
from hybrid_kv_plugin.scheduler_kind import manager_of_async_scheduler, outputs_arrive_late

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = "vllm.v1.core.single_type_kv_cache_manager:MambaManager.get_num_blocks_to_allocate"
PARAMS = (
    "self", "request_id", "num_tokens", "new_computed_blocks", "total_computed_tokens",
    "num_local_computed_tokens", "num_tokens_main_model", "apply_admission_cap",
)
# What the cap reads is what the stock count reads for this case.
READS = frozenset({"req_to_blocks", "_partial_hit_reqs", "num_speculative_blocks", "mamba_cache_mode", "block_size"})
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "vllm_fix"
INSTALLS = Installs(when=lambda adapter: not adapter.mamba_chunk_count_capped, since="0.26.0", removed_in="0.31.0")


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="mamba_chunk_count_capped",
        target=TARGET,
        fingerprint=ReadsFingerprint(params=PARAMS, exact=True, self_reads=READS, at_least=True),
        build=_wrap,
        why="the align Mamba manager counts a resumed chunk owing only its copy two or three blocks, not one",
        upstream="vLLM 0.31.0 caps the count at what the chunk allocates (physical_block_cap)",
        inert_for=lambda _, scheduler: not outputs_arrive_late(scheduler),
    )


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def get_num_blocks_to_allocate(
        self: Any,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Any,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
    ) -> int:
        count = original(
            self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
            num_local_computed_tokens, num_tokens_main_model, apply_admission_cap,
        )
        # Most calls count at most one block or bring a new hit: the wheel's count stands.
        if (
            count < 2
            or new_computed_blocks
            or self.num_speculative_blocks
            or self.mamba_cache_mode != "align"
            or not manager_of_async_scheduler(self)
        ):
            return count
        missing = -(-num_tokens_main_model // self.block_size) - len(self.req_to_blocks[request_id])
        owed_copy = request_id in self._partial_hit_reqs
        return min(count, max(missing, 0) + owed_copy)

    return get_num_blocks_to_allocate
