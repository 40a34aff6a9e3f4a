"""vLLM 0.26.x: no NIXL SSM clip, no Mamba boundary handoffs, no junction checkpoint."""

from __future__ import annotations

from hybrid_kv_plugin.adapters.base import VllmAdapter
from hybrid_kv_plugin.adapters.capabilities import Feature


class Vllm026Adapter(VllmAdapter):
    families = ((0, 26),)
    tested_wheels = ("0.26.0",)
    backports_shipped = VllmAdapter.backports_shipped | {
        Feature.NIXL_SSM_SLOT_PAIRING,
        Feature.MAMBA_JUNCTION_CHECKPOINT,
    }

    def installs_backport(self, feature: Feature) -> bool:
        if feature is Feature.NIXL_SSM_SLOT_PAIRING and _nixl_scheduler_clips_ssm():
            return False
        return super().installs_backport(feature)


def _nixl_scheduler_clips_ssm() -> bool:
    """Capability probe: a 0.26.x build that already carries vLLM 0.27's SSM-aware clip needs no backport."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import NixlBaseConnectorScheduler
    except Exception:  # the patch resolution reports an unimportable target precisely
        return False
    return hasattr(NixlBaseConnectorScheduler, "get_exchange_clipped_blocks")
