"""vLLM 0.33.x: request hashes include lookahead tokens; KVCacheConfig carries the hash sizes."""

from __future__ import annotations

from typing import Any

from hybrid_kv_plugin.adapters.probes import has
from hybrid_kv_plugin.adapters.vllm_0_31 import Vllm031Adapter
from hybrid_kv_plugin.adapters.vllm_0_32 import Vllm032Adapter


class Vllm033Adapter(Vllm032Adapter):
    families = ((0, 33),)
    tested_wheels = ("0.33.0",)
    hashes_lookahead_tokens = True
    # kv_cache_planning.get_global_kv_cache_groups marks groups by ``spec.is_draft``.
    eagle_groups_follow_draft_layers = True
    kv_cache_config_carries_hash_sizes = True
    simplecpu_stock_keys = Vllm032Adapter.simplecpu_stock_keys | {"num_cpu_blocks"}
    simplecpu_block_count_gated_by_name = True

    def scheduler_eagle_drop(self, vllm_config: Any) -> bool:
        # Where request hashes include the drafter's lookahead tokens, they prove the boundary
        # token and the Scheduler drops nothing (0 with a KV connector: legacy hashes).
        return super().scheduler_eagle_drop(vllm_config) and not vllm_config.num_hash_lookahead_tokens

    @classmethod
    def probe(cls) -> bool:
        return Vllm031Adapter.probe() and has("vllm.config", "VllmConfig.num_hash_lookahead_tokens")
