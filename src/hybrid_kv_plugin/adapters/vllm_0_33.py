"""vLLM 0.33.x: request hashes include lookahead tokens; KVCacheConfig carries the hash sizes."""

from hybrid_kv_plugin.adapters.vllm_0_31 import Vllm031Adapter


class Vllm033Adapter(Vllm031Adapter):
    families = ((0, 33),)
    tested_wheels = ("0.33.0",)
    hashes_lookahead_tokens = True
    kv_cache_config_carries_hash_sizes = True
    simplecpu_stock_keys = Vllm031Adapter.simplecpu_stock_keys | {"num_cpu_blocks"}
