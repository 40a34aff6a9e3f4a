"""vLLM 0.30.x: SimpleCPU fine-grained hybrid hits (PR #54736) and the junction flag (PR #53945) are native."""

from typing import Any

from hybrid_kv_plugin.adapters.capabilities import Feature
from hybrid_kv_plugin.adapters.probes import cache_config_fields
from hybrid_kv_plugin.adapters.vllm_0_29 import Vllm029Adapter


class Vllm030Adapter(Vllm029Adapter):
    families = ((0, 30),)
    tested_wheels = ("0.30.0",)
    has_native_fine_grained_cpu_hits = True
    simplecpu_scans_mamba_positionally = False
    # Native wins: the 0.29 backports of both features are not shipped (nor installed) here.
    backports_shipped = Vllm029Adapter.backports_shipped - {
        Feature.FINE_GRAINED_CPU_HITS,
        Feature.MAMBA_SHARED_PREFIX_CHECKPOINT,
    }
    simplecpu_worker_submits_without_forward = True
    simplecpu_partial_tail_finder = "_find_fa_partial_tail_source"
    kv_load_failure_by_request = True
    native_junction_flag = "enable_mamba_fine_grained_prefix_cache"
    native_junction_scheduler_attr = "mamba_fine_grained_prefix_cache"
    native_junction_manager_attr = "fine_grained_prefix_cache"
    scheduler_eagle_drop_attr = "use_eagle_block_drop"
    # The Mamba manager's prompt tail sits one unit lower under EAGLE block drop, switch or not.
    native_prompt_tail_eagle_shift = True
    mamba_partial_tail_producer_holds_block = True
    # MambaManager.cache_blocks(..., replay_boundaries=...): retention 0 keeps only those.
    mamba_retention_keeps_replay_boundaries = True
    # MambaManager holds more than 30 attributes from its constructor on.
    mamba_manager_attributes_past_inline = True

    def scheduler_eagle_drop(self, vllm_config: Any) -> bool:
        return _eagle_block_drop(vllm_config)

    def cpu_tier_lookup_drops_unit(self, vllm_config: Any) -> bool:
        # Built with use_eagle_block_drop() whatever the request hashes carry (0.30-0.33).
        return _eagle_block_drop(vllm_config)

    def offload_group_block_sizes(self, coordinator: Any) -> tuple[int, ...]:
        return tuple(coordinator.group_block_sizes)

    def offload_positionally_stable(self, manager: Any) -> bool:
        return bool(manager.has_positionally_stable_blocks)

    def mamba_exports_checkpoint(self, manager: Any, request_id: str) -> bool:
        # MambaManager._checkpoints: the reserved slot of a backend-exported checkpoint.
        return request_id in manager._checkpoints

    @classmethod
    def probe(cls) -> bool:
        return "enable_mamba_fine_grained_prefix_cache" in cache_config_fields()


def _eagle_block_drop(vllm_config: Any) -> bool:
    """SpeculativeConfig.use_eagle_block_drop(): EAGLE-style drafters unless the drop is disabled."""
    speculative_config = vllm_config.speculative_config
    return speculative_config is not None and bool(speculative_config.use_eagle_block_drop())
