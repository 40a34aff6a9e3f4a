"""vLLM 0.27.x: the NIXL scheduler clips SSM exchange lists natively (seed 004)."""

from typing import Any

from hybrid_kv_plugin.adapters.vllm_0_26 import Vllm026Adapter


class Vllm027Adapter(Vllm026Adapter):
    families = ((0, 27),)
    tested_wheels = ("0.27.1",)
    has_native_nixl_ssm_clip = True
    # The Mamba split caps prefill chunks by the scheduler budget; the partial-tail
    # checkpoint records its producer request (for connector hand-off).
    junction_split_reads = Vllm026Adapter.junction_split_reads | {"max_num_scheduled_tokens", "scheduler_config"}
    mamba_partial_tail_reads = Vllm026Adapter.mamba_partial_tail_reads | {"_producer_partial_tail_reqs"}
    mamba_tracks_partial_tail_producers = True
    mamba_lookup_trim_patch_needed = True

    def nixl_patch_specs(self) -> list:
        """Seed 004 is native here (``get_exchange_clipped_blocks``): delegate, patch nothing."""
        return []

    def partial_tail_pins(self, kv_cache_manager: Any) -> list[Any]:
        """GPU blocks the KV-cache manager pins for its own prompt-tail hand-off.

        0.27-0.28 offer a producer's prompt-tail copy as ``SchedulerOutput.partial_tail_offloads``
        to a producer-side connector and hold one reference on it until the request's blocks
        are freed (``KVCacheManager._partial_tail_pins``); 0.29 dropped that channel.
        """
        pins = getattr(kv_cache_manager, "_partial_tail_pins", None) or {}
        return [block for blocks in pins.values() for block in blocks]
