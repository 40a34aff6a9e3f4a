"""vLLM 0.31.x: the junction flag is renamed ``enable_mamba_shared_prefix_checkpoint``."""

from hybrid_kv_plugin.adapters.probes import cache_config_fields
from hybrid_kv_plugin.adapters.vllm_0_30 import Vllm030Adapter


class Vllm031Adapter(Vllm030Adapter):
    families = ((0, 31),)
    tested_wheels = ("0.31.0",)
    native_junction_flag = "enable_mamba_shared_prefix_checkpoint"
    native_junction_scheduler_attr = "mamba_shared_prefix_checkpoint"
    native_junction_manager_attr = "shared_prefix_checkpoint"
    has_native_simplecpu_metrics = True
    mamba_chunk_count_capped = True
    # Block-holding waiting requests have their own queue, drained before ``waiting``.
    first_waiting_queue_attr = "kv_holding_waiting"

    @classmethod
    def probe(cls) -> bool:
        return "enable_mamba_shared_prefix_checkpoint" in cache_config_fields()
