"""vLLM 0.30.x: SimpleCPU fine-grained hybrid hits (PR #54736) and the junction flag (PR #53945) are native."""

from hybrid_kv_plugin.adapters.vllm_0_29 import Vllm029Adapter


class Vllm030Adapter(Vllm029Adapter):
    families = ((0, 30),)
    tested_wheels = ("0.30.0",)
    has_native_fine_grained_cpu_hits = True
    native_junction_flag = "enable_mamba_fine_grained_prefix_cache"
