"""vLLM 0.28.x: SimpleCPU gains a disk tier; hash-size resolution reads the Mamba cache mode."""

from typing import Any

from hybrid_kv_plugin.adapters.probes import parameters
from hybrid_kv_plugin.adapters.vllm_0_27 import Vllm027Adapter


class Vllm028Adapter(Vllm027Adapter):
    families = ((0, 28),)
    tested_wheels = ("0.28.0",)
    nixl_pairing_ratio_args = 2
    cache_block_size_is_mamba_block_size = False
    # truncate_computed_blocks caps Mamba groups itself.
    mamba_lookup_trim_patch_needed = False
    mamba_marks_requests_allocating_nothing = True
    llm_engine_drops_stats_without_outputs = False
    simplecpu_stock_keys = Vllm027Adapter.simplecpu_stock_keys | {
        "kv_offload_backend",
        "disk_path",
        "disk_capacity_bytes",
        "disk_buffer_slots",
        "use_page_cache",
    }
    # Multi-module MTP: the coordinator leaves a re-prefillable tail uncached.
    junction_coordinator_extra_attrs = ("num_reprefillable_tokens",)

    def coordinator_reprefillable_tokens(self, coordinator: Any) -> int:
        return coordinator.num_reprefillable_tokens

    @classmethod
    def probe(cls) -> bool:
        return "num_prefill_lookahead" in parameters("vllm.v1.core.kv_cache_coordinator", "get_kv_cache_coordinator")
