"""The KV-cache geometry of a simulated hybrid model, and the vLLM configs built from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from hybrid_kv_plugin.models.environment import offline_environment as offline_environment  # examples import it here
from hybrid_kv_plugin.sim.wheel import make_kv_cache_tensor

MODEL_DIR = "tiny-qwen3-next"
DRAFT_DIR = "tiny-llama-draft"
ATTENTION_LAYER = "model.layers.3.self_attn.attn"
MAMBA_LAYER = "model.layers.0.linear_attn"
# The tiny model's other linear-attention layers, for the 2nd.. Mamba group (tiny-qwen3-next has 3).
EXTRA_MAMBA_LAYERS = ("model.layers.1.linear_attn", "model.layers.2.linear_attn")
DRAFT_LAYER = "draft_model.layers.0.self_attn.attn"
# Bytes of one attention page: block_size tokens x 1 head x 16 dims x fp16 x (K, V).
_ATTN_BYTES_PER_TOKEN = 1 * 16 * 2 * 2


def data_dir(name: str) -> str:
    return str(resources.files("hybrid_kv_plugin.sim") / "data" / name)


@dataclass(frozen=True)
class HybridGeometry:
    """One full-attention group plus ``mamba_groups`` Mamba groups, page sizes equal (as vLLM requires).

    ``hash_block_size`` is the prefix-match unit (``CacheConfig.prefix_match_unit``).
    ``mamba_groups`` is what one Mamba state costs in pool blocks: vLLM's planner puts as many
    layers in a group as the smallest layer kind has (Qwen3-Next: 12 attention + 36 Mamba
    layers, so 1 attention group and 3 Mamba groups), and a state at one position takes one
    block in every Mamba group, where a block of attention KV takes one.
    """

    attention_block_size: int = 16
    mamba_block_size: int = 64
    hash_block_size: int = 16
    mamba_cache_mode: str = "align"
    num_gpu_blocks: int = 256
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 64
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    eagle: bool = False
    num_speculative_tokens: int = 1
    # With ``eagle``: the SpeculativeConfig method; the draft is the tiny Llama in data/.
    speculative_method: str = "eagle"
    extra_cache_config: dict[str, Any] = field(default_factory=dict)
    # With ``eagle``: more SpeculativeConfig fields (wheel-specific, e.g. 0.33's
    # ``disable_lookahead_block_hashes``).
    extra_speculative_config: dict[str, Any] = field(default_factory=dict)
    # Sparse prefix-cache retention (None = dense, the sim's default). Carried by the
    # KVCacheConfig where the wheel reads it from there (0.29+); older coordinators read
    # ``adapter.retention_interval_env_var`` instead, which the caller sets.
    prefix_cache_retention_interval: int | None = None
    # Only the full-attention group, as a non-hybrid model has (the Mamba fields are
    # then ignored and the cache runs without a Mamba cache mode).
    full_attention_only: bool = False
    # Mamba groups over the shared pool (the resolved model's Mamba layers / layers per group).
    mamba_groups: int = 1

    @property
    def attention_page_bytes(self) -> int:
        return self.attention_block_size * _ATTN_BYTES_PER_TOKEN

    def mamba_state_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        # Two fp16 tensors whose bytes add up to one attention page.
        elems = self.attention_page_bytes // 2 // 2
        return (1, elems), (1, elems)


def build_vllm_config(
    geometry: HybridGeometry,
    adapter: Any,
    *,
    kv_connector: str | None = None,
    kv_connector_extra_config: dict[str, Any] | None = None,
    additional_config: dict[str, Any] | None = None,
) -> Any:
    """A real ``VllmConfig`` for the tiny hybrid model shipped with the plugin (no weights, no tokenizer)."""
    offline_environment()
    # vLLM inspects the model class in a fresh subprocess (which imports vLLM again: 23 s per
    # engine built on a 2-core host); a simulated engine forks nothing, so it runs here.
    from hybrid_kv_plugin.models.inspection import model_inspection

    with model_inspection():
        return _build_vllm_config(geometry, adapter, kv_connector, kv_connector_extra_config, additional_config)


def _build_vllm_config(
    geometry: HybridGeometry,
    adapter: Any,
    kv_connector: str | None,
    kv_connector_extra_config: dict[str, Any] | None,
    additional_config: dict[str, Any] | None,
) -> Any:
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig

    model_config = ModelConfig(
        model=data_dir(MODEL_DIR), skip_tokenizer_init=True, max_model_len=geometry.max_model_len
    )
    cache_block_size = geometry.attention_block_size
    if adapter.cache_block_size_is_mamba_block_size and geometry.mamba_cache_mode == "align":
        cache_block_size = geometry.mamba_block_size
    if geometry.full_attention_only:
        cache_block_size = geometry.attention_block_size
    retention: dict[str, Any] = {}
    if geometry.prefix_cache_retention_interval is not None and adapter.retention_interval_env_var is None:
        # The CacheConfig says what the KVCacheConfig carries (a server derives one from the other).
        retention["prefix_cache_retention_interval"] = geometry.prefix_cache_retention_interval
    cache_config = CacheConfig(
        block_size=cache_block_size,
        enable_prefix_caching=geometry.enable_prefix_caching,
        mamba_cache_mode="none" if geometry.full_attention_only else geometry.mamba_cache_mode,
        prefix_match_unit=geometry.hash_block_size,
        **retention,
        **geometry.extra_cache_config,
    )
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=geometry.max_num_batched_tokens,
        max_num_seqs=geometry.max_num_seqs,
        max_model_len=geometry.max_model_len,
        is_encoder_decoder=False,
    )
    kv_transfer_config = None
    if kv_connector is not None:
        kv_transfer_config = KVTransferConfig(
            kv_connector=kv_connector,
            kv_role="kv_both",
            kv_connector_extra_config=dict(kv_connector_extra_config or {}),
        )
    kwargs: dict[str, Any] = {}
    if additional_config is not None:
        kwargs["additional_config"] = additional_config
    if geometry.eagle:
        kwargs["speculative_config"] = build_speculative_config(geometry, model_config)
    return VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=kv_transfer_config,
        **kwargs,
    )


def build_speculative_config(geometry: HybridGeometry, model_config: Any) -> Any:
    """A real EAGLE ``SpeculativeConfig``, built offline: the draft is a local directory
    holding only a hand-written tiny Llama ``config.json`` (same arguments on 0.26-0.33)."""
    from vllm.config import ParallelConfig, SpeculativeConfig

    return SpeculativeConfig(
        method=geometry.speculative_method,
        num_speculative_tokens=geometry.num_speculative_tokens,
        model=data_dir(DRAFT_DIR),
        target_model_config=model_config,
        target_parallel_config=ParallelConfig(),
        **geometry.extra_speculative_config,
    )


def build_kv_cache_config(geometry: HybridGeometry, adapter: Any) -> Any:
    """The hybrid ``KVCacheConfig`` an engine would derive: FA group + Mamba group over one pool."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    attention = FullAttentionSpec(
        block_size=geometry.attention_block_size, num_kv_heads=1, head_size=16, dtype=torch.float16
    )
    if geometry.full_attention_only:
        tensor = make_kv_cache_tensor(
            adapter, attention.page_size_bytes * geometry.num_gpu_blocks, [ATTENTION_LAYER], attention.page_size_bytes
        )
        return KVCacheConfig(
            num_blocks=geometry.num_gpu_blocks,
            kv_cache_tensors=[tensor],
            kv_cache_groups=[KVCacheGroupSpec([ATTENTION_LAYER], attention)],
        )
    mamba = MambaSpec(
        block_size=geometry.mamba_block_size,
        shapes=geometry.mamba_state_shapes(),
        dtypes=(torch.float16, torch.float16),
        mamba_cache_mode=geometry.mamba_cache_mode,
        **({"num_speculative_blocks": geometry.num_speculative_tokens} if geometry.eagle else {}),
    )
    assert attention.page_size_bytes == mamba.page_size_bytes, "hybrid groups must share one page size"
    page = attention.page_size_bytes
    attention_layers = [ATTENTION_LAYER] + ([DRAFT_LAYER] if geometry.eagle else [])
    mamba_layers = mamba_layer_names(geometry.mamba_groups)
    tensor = make_kv_cache_tensor(
        adapter, page * geometry.num_gpu_blocks, [*attention_layers, *mamba_layers], page
    )
    retention: dict[str, Any] = {}
    if geometry.prefix_cache_retention_interval is not None and adapter.retention_interval_env_var is None:
        retention["prefix_cache_retention_interval"] = geometry.prefix_cache_retention_interval
    return KVCacheConfig(
        num_blocks=geometry.num_gpu_blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[
            KVCacheGroupSpec(attention_layers, attention),
            *(KVCacheGroupSpec([name], mamba) for name in mamba_layers),
        ],
        **retention,
    )


def mamba_layer_names(groups: int) -> list[str]:
    """One layer name per Mamba group: the first is ``MAMBA_LAYER``; past the tiny model's
    layers the names are synthetic (the scheduler side reads groups, never layer modules)."""
    if groups < 1:
        raise ValueError(f"mamba_groups must be at least 1, got {groups}")
    names = [MAMBA_LAYER, *EXTRA_MAMBA_LAYERS]
    names += [f"model.layers.{100 + i}.linear_attn" for i in range(len(names), groups)]
    return names[:groups]
