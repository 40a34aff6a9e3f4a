"""vLLM 0.32.x: the prompt-tail Mamba checkpoint moves to the last hash boundary <= N-1."""

from hybrid_kv_plugin.adapters.probes import has
from hybrid_kv_plugin.adapters.vllm_0_31 import Vllm031Adapter


class Vllm032Adapter(Vllm031Adapter):
    families = ((0, 32),)
    tested_wheels = ("0.32.0",)
    # kv_cache_interface.get_mamba_prefill_checkpoint_position leaves the last prompt
    # token to recompute, so an exact replay of the prompt hits the kept state.
    native_prompt_tail_keeps_replay_position = True
    # ... which a later prompt chunk always follows: never keyed again after a decode.
    native_prompt_tail_keyed_after_its_chunk = False

    @classmethod
    def probe(cls) -> bool:
        return Vllm031Adapter.probe() and has("vllm.distributed.kv_transfer.kv_connector.utils", "clip_ssm_state_blocks")
