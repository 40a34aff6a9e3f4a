"""vLLM 0.26.x: no NIXL SSM clip, no Mamba boundary handoffs, no junction checkpoint (0.26-0.28 get all three backported)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybrid_kv_plugin.adapters.base import VllmAdapter
from hybrid_kv_plugin.adapters.capabilities import Feature

if TYPE_CHECKING:
    from hybrid_kv_plugin.patching import PatchSpec


class Vllm026Adapter(VllmAdapter):
    families = ((0, 26),)
    tested_wheels = ("0.26.0",)
    backports_shipped = VllmAdapter.backports_shipped | {
        Feature.NIXL_SSM_SLOT_PAIRING,
        Feature.MAMBA_JUNCTION_CHECKPOINT,
        # Seed 000: the plugin adds the 0.29 boundary hand-off channel, then runs the
        # same fine-grained SimpleCPU scheduler as on 0.29 (hybrid_kv_plugin.offload).
        Feature.FINE_GRAINED_CPU_HITS,
    }
    boundary_handoff_patch_needed = True
    # 0.26-0.28 workers submit loads and stores from get_finished(), which runs on
    # steps without a forward pass too (0.29 moved stores into wait_for_save()).
    simplecpu_worker_submits_without_forward = True
    # The scheduler trims a local hit for a longer external one with a truncate that
    # asserts every group covers the prefix, Mamba included (0.27 only: 0.26 has no
    # such trim, 0.28 caps Mamba groups).
    mamba_lookup_trim_patch_needed = False

    def nixl_patch_specs(self) -> list[PatchSpec]:
        """Seed 004 backport: SSM-aware exchange clip (schedulers) + state-slot pairing (worker)."""
        if self.has_native_nixl_ssm_clip or _nixl_scheduler_clips_ssm():
            return []
        from hybrid_kv_plugin.patches import nixl_exchange_clip, nixl_save_meta, nixl_worker_pairing

        return [nixl_exchange_clip.spec(self), nixl_save_meta.spec(self), nixl_worker_pairing.spec(self)]

    def junction_patch_specs(self) -> list[PatchSpec]:
        """Seed 003 backport (0.26-0.29): the split adds the junction stop; the coordinator owns the plan."""
        from hybrid_kv_plugin.patches import junction_coordinator, junction_split

        return [junction_coordinator.spec(self), junction_split.spec(self)]

    def cpu_offload_patch_specs(self) -> list[PatchSpec]:
        """Seed 000 prerequisite (0.26-0.28): record the Mamba boundary hand-offs and publish them."""
        if not self.boundary_handoff_patch_needed:
            return []
        from hybrid_kv_plugin.patches import boundary_handoff_publish, mamba_boundary_handoffs, truncate_mamba_lookup

        specs = [*mamba_boundary_handoffs.specs(self), boundary_handoff_publish.spec(self)]
        if self.mamba_lookup_trim_patch_needed:
            specs.append(truncate_mamba_lookup.spec(self))
        return specs


def _nixl_scheduler_clips_ssm() -> bool:
    """Capability probe: a 0.26.x build that already carries vLLM 0.27's SSM-aware clip needs no backport."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import NixlBaseConnectorScheduler
    except Exception:  # the patch resolution reports an unimportable target precisely
        return False
    return hasattr(NixlBaseConnectorScheduler, "get_exchange_clipped_blocks")
