"""Patch ``HybridKVCacheCoordinator.find_longest_cache_hit_per_group``: one hit every group holds (0.26).

Why: with any KV connector on a hybrid (attention + Mamba) model, the vLLM 0.26
scheduler looks a waiting request up group by group and takes the *deepest* group's
hit as the local prefix, assuming the connector brings the lagging group's data
(only NIXL does: it always sends the Mamba state). With SimpleCPU or any other
connector nothing does: when attention blocks outlive the Mamba state the request
starts from a Mamba block nobody wrote (the byte check of ``sim/byte_cache.py``:
a fresh block holding another request's attention content read as the state after
144 tokens; ``tests/test_byte_cache.py``), and when the Mamba state outlives attention
blocks the attention prefix is missing - on a 32-token attention block the hit ends
inside a block the request does not hold and ``_apply_cow`` asserts
(``block_idx < len(req_blocks)``, the randomized ``plugin-fa32`` variant).

What it changes: where the groups' hits differ, the per-group lookup returns the
reconciled lookup of ``find_longest_cache_hit`` (what ``get_computed_blocks`` uses,
every group holding its data at one boundary) for every group; equal hits are
returned unchanged. The connector is then asked from that boundary, so an external
hit still supplies everything past it (NIXL sends attention blocks it could have
reused locally: correct, less reuse). A request that ``local_hit_admission`` admits
without its hit this time (it never fits the pool with it) gets no hit here either:
this lookup gets the request's hashes, not the request, and never reads
``skip_reading_prefix_cache`` (0.27's connector path does), so without it such a
request kept its hit and waited for ever (soak ``plugin`` attention 64, seed 8, async).

Upstream: vLLM 0.27.0 (``KVCacheManager.get_computed_blocks_for_connector``: a group
deeper than full attention, or a divergent hit no external tokens back, falls back
to the reconciled lookup). Installed on 0.26.x only; first version where it is
removed: 0.27.0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.patches.local_hit_admission import reads_no_cache
from hybrid_kv_plugin.patching import Installs, PatchSpec, ReadsFingerprint

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = "vllm.v1.core.kv_cache_coordinator:HybridKVCacheCoordinator.find_longest_cache_hit_per_group"
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "vllm_fix"
INSTALLS = Installs(
    when=lambda adapter: adapter.connector_lookup_takes_deepest_group,
    since="0.26.0",
    removed_in="0.27.0",
)


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="connector_hit_reconcile",
        target=TARGET,
        # Exactly the 0.26 body: each group's manager looked up on its own.
        fingerprint=ReadsFingerprint(
            params=("self", "block_hashes", "max_cache_hit_length"),
            exact=True,
            self_reads=frozenset({"kv_cache_config", "attention_groups", "block_pool", "_cache_hit_alignment_tokens"}),
        ),
        build=_replacement,
        why="the connector path takes the deepest group's local hit, which the lagging group cannot serve",
        upstream="vLLM 0.27.0 (KVCacheManager.get_computed_blocks_for_connector reconciles divergent hits)",
    )


def _replacement(original: Any) -> Any:
    def find_longest_cache_hit_per_group(self: Any, block_hashes: Any, max_cache_hit_length: int) -> Any:
        if reads_no_cache(block_hashes):
            max_cache_hit_length = 0
        blocks, hits = original(self, block_hashes, max_cache_hit_length)
        if len(set(hits)) <= 1:
            return blocks, hits
        reconciled, hit_length, _uncached_prefix = self.find_longest_cache_hit(block_hashes, max_cache_hit_length)
        return reconciled, (hit_length,) * len(hits)

    find_longest_cache_hit_per_group.__wrapped__ = original  # fingerprints read the stock body through this
    find_longest_cache_hit_per_group.__doc__ = original.__doc__
    return find_longest_cache_hit_per_group
