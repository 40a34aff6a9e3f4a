"""Patch ``KVCacheManager.truncate_computed_blocks``: let an external hit supply the last Mamba state (0.27).

Why: when a request's local prefix hit ends inside a scheduler block and a KV
connector offers a longer external hit, the vLLM 0.27 scheduler trims the local hit
back to the block-aligned prefix with ``truncate_computed_blocks``, which asserts
that *every* group's lookup result covers that prefix. A Mamba ``align`` group's
result can end earlier (its state for the aligned prefix is not kept locally; the
external hit brings the final state), so the scheduler crashes. Only a connector
serving fine-grained hybrid hits gets there: the plugin's SimpleCPU backport on
0.27 did, in the randomized soak (seed 0, step ~300, ``AssertionError`` in
``truncate_computed_blocks``).

What it changes: the same slicing, except that a Mamba group keeps at most the
blocks its lookup found (vLLM 0.28 does exactly this); every other group still
asserts that it covers the prefix. Refcounts are untouched, as in the original.

Upstream: fixed in vLLM 0.28.0 (``truncate_computed_blocks`` caps Mamba groups).
Installed on 0.27.x only (0.26 has no such trim); first version where it is removed: 0.28.0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.patching import Installs, PatchSpec, ReadsFingerprint

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = "vllm.v1.core.kv_cache_manager:KVCacheManager.truncate_computed_blocks"
# Only where fine-grained hits reach the trim: the plugin's channel is installed and the trim asserts on Mamba.
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "vllm_fix"
INSTALLS = Installs(
    when=lambda adapter: adapter.boundary_handoff_patch_needed and adapter.mamba_lookup_trim_patch_needed,
    since="0.27.1",
    removed_in="0.28.0",
)


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="truncate_mamba_lookup",
        target=TARGET,
        # Exactly the 0.27 body: slice every group through the coordinator's managers.
        fingerprint=ReadsFingerprint(
            params=("self", "blocks", "num_computed_tokens"),
            exact=True,
            self_reads=frozenset({"coordinator", "create_kv_cache_blocks"}),
        ),
        build=_replacement,
        why="a Mamba group's local lookup may end before the aligned prefix an external hit resumes from",
        upstream="vLLM 0.28.0 (truncate_computed_blocks caps Mamba groups)",
    )


def _replacement(original: Any) -> Any:
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    def truncate_computed_blocks(self: Any, blocks: Any, num_computed_tokens: int) -> Any:
        truncated = []
        for group_blocks, manager in zip(blocks.blocks, self.coordinator.single_type_managers, strict=True):
            assert num_computed_tokens % manager.block_size == 0
            wanted = num_computed_tokens // manager.block_size
            if isinstance(manager, MambaManager):
                # The external hit brings the final state; keep what the lookup found.
                wanted = min(wanted, len(group_blocks))
            else:
                assert wanted <= len(group_blocks)
            truncated.append(list(group_blocks[:wanted]))
        return self.create_kv_cache_blocks(tuple(truncated))

    truncate_computed_blocks.__wrapped__ = original  # fingerprints read the stock body through this
    truncate_computed_blocks.__doc__ = original.__doc__
    return truncate_computed_blocks
