"""vLLM 0.29.x: MambaManager publishes boundary handoffs; KVCacheTensor uses the ``layers`` layout."""

from hybrid_kv_plugin.adapters.capabilities import Feature
from hybrid_kv_plugin.adapters.probes import has
from hybrid_kv_plugin.adapters.vllm_0_28 import Vllm028Adapter


class Vllm029Adapter(Vllm028Adapter):
    families = ((0, 29),)
    tested_wheels = ("0.29.0",)
    kv_cache_tensor_style = "layers"
    retention_interval_env_var = None
    has_boundary_handoffs = True
    boundary_handoff_patch_needed = False
    kv_cache_manager_pins_partial_tails = False
    # The worker submits stores only from wait_for_save(), which a step without a
    # forward pass never calls (the plugin's connector submits them on clear).
    simplecpu_worker_submits_without_forward = False
    first_waiting_queue_attr = "skipped_waiting"
    # The Mamba split knows internal prefill checkpoint blocks.
    mamba_split_reads = Vllm028Adapter.mamba_split_reads | {"mamba_has_prefill_checkpoint_blocks"}
    # HybridSimpleCPUConnector backports fine-grained CPU hits on this wheel
    # (hybrid_kv_plugin.offload; a SimpleCPUOffloadScheduler subclass, no vLLM patch).
    backports_shipped = Vllm028Adapter.backports_shipped | {Feature.FINE_GRAINED_CPU_HITS}
    # prompt_tail_checkpoint replay/both (patches prompt_tail_split, prompt_tail_manager): the
    # wheel writes the Mamba state at every chunk end and keeps partial tails by copy-on-write,
    # so scheduler-side patches suffice.
    prompt_tail_checkpoint_supported = True
    # mamba_output_checkpoint (patches output_checkpoint_bind, output_checkpoint_manager): the
    # manager moves a running request's partial key to a copy-on-write block before the next
    # forward pass, so the answer's last unit state can be kept from the scheduler side.
    output_checkpoint_supported = True
    # mamba_divergence_checkpoint: the junction backport's plan opens without EAGLE, and the kept
    # state reaches a connector through the wheel's boundary hand-offs.
    divergence_checkpoint_supported = True

    @classmethod
    def probe(cls) -> bool:
        return has("vllm.v1.core.sched.output", "KVConnectorBlockState")
