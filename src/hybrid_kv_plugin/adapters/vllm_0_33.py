"""vLLM 0.33.x: request hashes include lookahead tokens; KVCacheConfig carries the hash sizes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.adapters.vllm_0_32 import Vllm032Adapter

if TYPE_CHECKING:
    from hybrid_kv_plugin.patching import PatchSpec


class Vllm033Adapter(Vllm032Adapter):
    families = ((0, 33),)
    tested_wheels = ("0.33.0",)
    hashes_lookahead_tokens = True
    kv_cache_config_carries_hash_sizes = True
    simplecpu_stock_keys = Vllm032Adapter.simplecpu_stock_keys | {"num_cpu_blocks"}
    simplecpu_block_count_gated_by_name = True

    def cpu_offload_patch_specs(self) -> list[PatchSpec]:
        from hybrid_kv_plugin.patches import offload_has_connector

        return [offload_has_connector.spec(self)]

    def eagle_block_drop_options(self) -> dict[str, Any]:
        # Lookahead block hashes prove the boundary token, so EAGLE drops no unit by default.
        return {"disable_lookahead_block_hashes": True}

    def mark_eagle_groups(self, vllm_config: Any, kv_cache_config: Any, draft_layers: frozenset[str]) -> None:
        # 0.33 (kv_cache_planning.get_global_kv_cache_groups): under EAGLE block drop, a group
        # is an EAGLE group exactly when it holds a draft layer (spec.is_draft).
        speculative_config = vllm_config.speculative_config
        if speculative_config is None or not speculative_config.use_eagle_block_drop():
            return
        for group in kv_cache_config.kv_cache_groups:
            group.is_eagle_group = not draft_layers.isdisjoint(group.layer_names)
