"""vLLM 0.27.x: the NIXL scheduler clips SSM exchange lists natively (seed 004)."""

from hybrid_kv_plugin.adapters.vllm_0_26 import Vllm026Adapter


class Vllm027Adapter(Vllm026Adapter):
    families = ((0, 27),)
    tested_wheels = ("0.27.1",)
    has_native_nixl_ssm_clip = True

    def nixl_patch_specs(self) -> list:
        """Seed 004 is native here (``get_exchange_clipped_blocks``): delegate, patch nothing."""
        return []
