"""vLLM 0.26.x: no NIXL SSM clip, no Mamba boundary handoffs, no junction checkpoint."""

from hybrid_kv_plugin.adapters.base import VllmAdapter


class Vllm026Adapter(VllmAdapter):
    families = ((0, 26),)
    tested_wheels = ("0.26.0",)
