"""Patch ``SimpleCPUOffloadScheduler._find_fa_partial_tail_source``: the CPU tier stores the answer's attention partial block.

Why: when a request finishes, the wheel's SimpleCPU scheduler side stores one
full-attention block that is not whole: the one holding the prompt's last hash
boundary, where the wheel keys its partial tail. ``mamba_output_checkpoint``
keeps the answer's last Mamba state and ``prompt_tail_attention`` keys the
attention block holding it there; with an attention block coarser than the
prefix-match unit that block is usually not whole when the answer ends, so the CPU
tier held the Mamba state but not the attention it needs (measured with attention
block 32, unit 16: the next turn's CPU hit after an answer that computed up to
349 stopped at 320 instead of 336).

What it changes: for a request with a kept answer state
(:func:`hybrid_kv_plugin.attention_partial_block.last_answer_position`) the block
located is the one holding that position, with the same checks as the wheel's
(keyed there, not a null block, not already stored or in flight); an answer
position later than the prompt's boundary means the prompt's block is whole and
already stored. Requests without kept answer states (option off) get the wheel's
method. The 0.29 backport (``FineGrainedOffloadScheduler``) does the same itself.

Upstream: none (vLLM stores only the prompt's attention partial tail); installed
on 0.30.0-0.33.x, where the wheel's own SimpleCPU scheduler serves fine-grained
hits.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.attention_partial_block import ANSWER_STATES_ATTR, last_answer_position, partial_tail_block
from hybrid_kv_plugin.patching import Installs, PatchSpec, ReadsFingerprint

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = "vllm.v1.simple_kv_offload.manager:SimpleCPUOffloadScheduler._find_fa_partial_tail_source"
PARAMS = ("self", "request", "block_ids")
# What partial_tail_block reads, the same fields the wheel's method reads with the same meaning.
READS = frozenset(
    {"cpu_coordinator", "_gpu_block_pool", "hash_block_size", "fa_block_size", "fa_gidx",
     "_in_flight_store_gpu_blocks", "cpu_block_pool"}
)
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "mamba_output_checkpoint"
INSTALLS = Installs(
    when=lambda adapter: adapter.output_checkpoint_supported and adapter.has_native_fine_grained_cpu_hits,
    since="0.30.0",
)


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="output_checkpoint_offload",
        target=TARGET,
        fingerprint=ReadsFingerprint(params=PARAMS, exact=True, self_reads=READS, at_least=True),
        build=_wrap,
        why="store the attention partial block holding the answer's kept Mamba state on the CPU tier",
        upstream="none (vLLM stores only the prompt's attention partial tail)",
    )


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def _find_fa_partial_tail_source(self: Any, request: Any, block_ids: Any) -> int | None:
        # Asked at every request's finish; most kept no answer state (all, with the option
        # off): one attribute test before anything is called.
        if not getattr(request, ANSWER_STATES_ATTR, None):
            return original(self, request, block_ids)
        answer = last_answer_position(request)
        if answer is None or not self.cpu_coordinator.enable_partial_hash_hits:
            return original(self, request, block_ids)
        block = partial_tail_block(self, request, block_ids, answer)
        return None if block is None else block.block_id

    return _find_fa_partial_tail_source
