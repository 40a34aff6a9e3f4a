"""vLLM 0.27.x: the NIXL scheduler clips SSM exchange lists natively (Mamba state-slot pairing)."""

from typing import Any

from hybrid_kv_plugin.adapters.vllm_0_26 import Vllm026Adapter, _nixl_scheduler_clips_ssm


class Vllm027Adapter(Vllm026Adapter):
    families = ((0, 27),)
    tested_wheels = ("0.27.1",)
    has_native_nixl_ssm_clip = True
    # The Mamba split caps prefill chunks by the scheduler budget; the partial-tail
    # checkpoint records its producer request (for connector hand-off).
    mamba_split_reads = Vllm026Adapter.mamba_split_reads | {"max_num_scheduled_tokens", "scheduler_config"}
    mamba_partial_tail_reads = Vllm026Adapter.mamba_partial_tail_reads | {"_producer_partial_tail_reqs"}
    mamba_tracks_partial_tail_producers = True
    # Its local-hit trim asserts every group covers the prefix, Mamba included.
    mamba_lookup_trim_patch_needed = True
    connector_lookup_takes_deepest_group = False
    # A producer's prompt-tail copy is offered as SchedulerOutput.partial_tail_offloads and
    # pinned by the KV-cache manager until the request's blocks are freed.
    kv_cache_manager_pins_partial_tails = True
    # Every prompt chunk ends on the Mamba grid (vLLM PR #51113).
    mamba_split_aligns_below_cache_limit_only = False

    def cpu_tier_lookup_drops_unit(self, vllm_config: Any) -> bool:
        # The SimpleCPU coordinator is built with the drafter's use_eagle() (0.27-0.29).
        return self.scheduler_eagle_drop(vllm_config)

    @classmethod
    def probe(cls) -> bool:
        return _nixl_scheduler_clips_ssm()
