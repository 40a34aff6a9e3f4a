"""vLLM 0.26.x: no NIXL SSM clip, no Mamba boundary handoffs, no junction checkpoint (0.26-0.28 get all three backported)."""

from __future__ import annotations

from hybrid_kv_plugin.adapters.base import VllmAdapter
from hybrid_kv_plugin.adapters.capabilities import Feature


class Vllm026Adapter(VllmAdapter):
    families = ((0, 26),)
    tested_wheels = ("0.26.0",)
    backports_shipped = VllmAdapter.backports_shipped | {
        Feature.NIXL_SSM_SLOT_PAIRING,
        Feature.MAMBA_SHARED_PREFIX_CHECKPOINT,
        # Fine-grained CPU hits: the plugin adds the 0.29 boundary hand-off channel, then
        # runs the same fine-grained SimpleCPU scheduler as on 0.29 (hybrid_kv_plugin.offload).
        Feature.FINE_GRAINED_CPU_HITS,
    }
    boundary_handoff_patch_needed = True
    # 0.26-0.28 workers submit loads and stores from get_finished(), which runs on
    # steps without a forward pass too (0.29 moved stores into wait_for_save()).
    simplecpu_worker_submits_without_forward = True
    # 0.26 has no local-hit trim for a longer external hit (0.27 does; 0.28 caps Mamba groups).
    mamba_lookup_trim_patch_needed = False
    # Its connector path serves max(per-group hits) as the local prefix (0.27 reconciles).
    connector_lookup_takes_deepest_group = True
    mamba_marks_requests_allocating_nothing = False
    # LLMEngine.step() drops the stats of a step without request outputs (0.28 fixed it).
    llm_engine_drops_stats_without_outputs = True
    # Its split lets a chunk end mid-block above that limit (0.27 keeps every prompt chunk on the grid).
    mamba_split_aligns_below_cache_limit_only = True

    def installs_backport(self, feature: Feature) -> bool:
        if feature is Feature.NIXL_SSM_SLOT_PAIRING and _nixl_scheduler_clips_ssm():
            return False
        return super().installs_backport(feature)

    @classmethod
    def probe(cls) -> bool:
        # The oldest family: a vLLM that none of the newer families' probes matched.
        return True


def _nixl_scheduler_clips_ssm() -> bool:
    """Capability probe: a 0.26.x build that already carries vLLM 0.27's SSM-aware clip needs no backport."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import NixlBaseConnectorScheduler
    except Exception:  # the patch resolution reports an unimportable target precisely
        return False
    return hasattr(NixlBaseConnectorScheduler, "get_exchange_clipped_blocks")
