"""vLLM 0.29.x: MambaManager publishes boundary handoffs; KVCacheTensor uses the ``layers`` layout."""

from hybrid_kv_plugin.adapters.vllm_0_28 import Vllm028Adapter


class Vllm029Adapter(Vllm028Adapter):
    families = ((0, 29),)
    tested_wheels = ("0.29.0",)
    kv_cache_tensor_style = "layers"
    has_boundary_handoffs = True
