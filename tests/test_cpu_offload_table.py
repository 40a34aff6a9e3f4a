"""Seed 000 on every wheel: CPU-tier hits of hybrid prompts through HybridSimpleCPUConnector vs stock SimpleCPU.

Scenario (the user report): FA block 16, Mamba block 64 ``align``, hash block 16.
Request A (max_tokens=4), GPU prefix cache reset, then A's prompt + 3 new tokens.
The second request's hit comes from the CPU tier only.
"""

from __future__ import annotations

import pytest

from hybrid_kv_plugin.adapters import Feature, Support
from hybrid_kv_plugin.connector_names import CONNECTOR_NAME, STOCK_CONNECTOR_NAME
from hybrid_kv_plugin.offload.mode import OffloadMode
from hybrid_kv_plugin.sim import HybridGeometry
from hybrid_kv_plugin.sim.wheel import make_kv_cache_tensor, resolve_block_sizes

from helpers import tokens
from scenarios.offload import cpu_tier_hit, gpu_local_hit, offload_engine

PROMPTS = (320, 336, 352, 368, 400, 496)
# Where the GPU side keeps the prompt-tail Mamba state decides the best reachable hit:
# at the prompt's last hash boundary (<= 0.31) or at the last one <= N-1 (0.32+, which
# favours exact replays). A fine-grained CPU tier reproduces exactly that.
TAIL_AT_N = [320, 336, 352, 368, 400, 496]
TAIL_BEFORE_N = [320, 320, 336, 352, 384, 480]
PLUGIN_ROW = {
    # Backport: 0.26-0.28 with the boundary hand-off channel the plugin adds, 0.29 with its own.
    "0.26.0": TAIL_AT_N,
    "0.27.1": TAIL_AT_N,
    "0.28.0": TAIL_AT_N,
    "0.29.0": TAIL_AT_N,
    "0.30.0": TAIL_AT_N,
    "0.31.0": TAIL_AT_N,
    "0.32.0": TAIL_BEFORE_N,
    "0.33.0": TAIL_BEFORE_N,
}
BACKPORTED = ("0.26.0", "0.27.1", "0.28.0", "0.29.0")
STOCK_ROW = {
    "0.26.0": [320, 320, 320, 320, 384, 448],
    "0.27.1": [320, 320, 320, 320, 384, 448],
    "0.28.0": [320, 0, 0, 0, 0, 0],
    "0.29.0": [320, 0, 0, 0, 0, 0],
    **{v: row for v, row in PLUGIN_ROW.items() if v not in BACKPORTED},
}
# A with max_tokens=1: it finishes in the step that completes its prompt, so nothing
# is stored while it runs; only a flush at finish can keep its blocks.
# From 0.32 the prefill stops at the prompt-tail checkpoint, so A caches it while it runs.
PLUGIN_ROW_FINISH_ONLY = {
    # 0.26-0.27 retain every whole Mamba block on the GPU, so those still reach the CPU tier
    # through the committed-block hand-offs; the prompt-tail state of a request that finishes
    # in its prompt step is never copied out of its running block (no copy-on-write), on any
    # wheel up to 0.31, natively or backported.
    "0.26.0": [320, 320, 320, 320, 384, 448],
    "0.27.1": [320, 320, 320, 320, 384, 448],
    "0.28.0": [320, 0, 0, 0, 0, 0],
    "0.29.0": [320, 0, 0, 0, 0, 0],
    "0.30.0": [320, 0, 0, 0, 0, 0],
    "0.31.0": [320, 0, 0, 0, 0, 0],
    "0.32.0": TAIL_BEFORE_N,
    "0.33.0": TAIL_BEFORE_N,
}
STOCK_ROW_FINISH_ONLY = {
    "0.26.0": [0, 320, 320, 320, 384, 448],
    "0.27.1": [0, 320, 320, 320, 384, 448],
    "0.28.0": [0, 0, 0, 0, 0, 0],
    "0.29.0": [0, 0, 0, 0, 0, 0],
    **{v: row for v, row in PLUGIN_ROW_FINISH_ONLY.items() if v not in BACKPORTED},
}
OPT_OUT = {"fine_grained_hits": False}


def _feature(adapter) -> Support:
    return adapter.verdict(Feature.FINE_GRAINED_CPU_HITS).support


def _row(adapter, connector: str, max_tokens: int = 4, extra=None, configure=None) -> list[int]:
    engines = (offload_engine(adapter, connector, extra=extra, configure=configure) for _ in PROMPTS)
    return [cpu_tier_hit(run, tokens(n), max_tokens=max_tokens) for run, n in zip(engines, PROMPTS)]


def test_plugin_table(plugin, adapter):
    support = _feature(adapter)
    assert support is not Support.UNAVAILABLE  # backported on 0.26-0.29, native from 0.30
    mode = offload_engine(adapter, CONNECTOR_NAME).engine.connector.offload_mode
    assert mode is (OffloadMode.NATIVE if support is Support.NATIVE else OffloadMode.BACKPORT)
    plugin_row = _row(adapter, CONNECTOR_NAME)
    assert plugin_row == PLUGIN_ROW[adapter.version]
    # The CPU tier serves exactly what the GPU prefix cache would have served.
    assert plugin_row == [gpu_local_hit(adapter, tokens(n)) for n in PROMPTS]


def test_stock_table(plugin, adapter):
    assert _row(adapter, STOCK_CONNECTOR_NAME) == STOCK_ROW[adapter.version]


def test_opt_out_is_the_stock_connector(plugin, adapter):
    mode = offload_engine(adapter, CONNECTOR_NAME, extra=OPT_OUT).engine.connector.offload_mode
    assert mode is (OffloadMode.NATIVE if _feature(adapter) is Support.NATIVE else OffloadMode.STOCK)
    assert _row(adapter, CONNECTOR_NAME, extra=OPT_OUT) == STOCK_ROW[adapter.version]


def test_finish_flush_table(plugin, adapter):
    """max_tokens=1: only the blocks stored when A finishes can serve the replay."""
    assert _row(adapter, STOCK_CONNECTOR_NAME, max_tokens=1) == STOCK_ROW_FINISH_ONLY[adapter.version]
    assert _row(adapter, CONNECTOR_NAME, max_tokens=1) == PLUGIN_ROW_FINISH_ONLY[adapter.version]


def _dcp4(vllm_config) -> None:
    # Set after validation: a CPU test has one process, so tensor parallelism cannot be
    # raised to let DCP=4 pass the config validators; the scheduler side only reads it.
    vllm_config.parallel_config.decode_context_parallel_size = 4


# DCP 4 (attention block 64 = Mamba block): a prompt tail inside an attention block can
# only reach the CPU tier as the attention partial tail stored at finish. From 0.32 the
# GPU side registers that tail at the last hash boundary <= N-1, but SimpleCPU still looks
# for it at N (manager.py _find_fa_partial_tail_source), so tails off the 64 grid are lost:
# a native gap the plugin delegates to unchanged (it matches the stock connector there).
# 0.26-0.28 themselves serve no partial hit under this DCP geometry on the GPU (0.26-0.27:
# whole 64-token blocks only; 0.28: nothing off the 320 grid point); the CPU tier matches.
DCP_GPU_ROW = {
    "0.26.0": STOCK_ROW["0.26.0"],
    "0.27.1": STOCK_ROW["0.27.1"],
    "0.28.0": [320, 0, 0, 0, 0, 0],
}
DCP_ROW = {
    **DCP_GPU_ROW,
    "0.29.0": TAIL_AT_N,
    "0.30.0": TAIL_AT_N,
    "0.31.0": TAIL_AT_N,
    "0.32.0": [320, 320, 0, 0, 384, 0],
    "0.33.0": [320, 320, 0, 0, 384, 0],
}


def test_dcp_geometry(plugin, adapter):
    """Attention block = 16 x DCP 4 = 64 through the real coordinators; the replicated Mamba group stays 64."""
    support = _feature(adapter)
    run = offload_engine(adapter, CONNECTOR_NAME, configure=_dcp4)
    gpu_coordinator = run.engine.scheduler.kv_cache_manager.coordinator
    assert adapter.offload_group_block_sizes(gpu_coordinator) == (64, 64)
    assert adapter.offload_group_block_sizes(run.engine.offload_manager.cpu_coordinator) == (64, 64)
    assert run.engine.offload_manager.group_block_sizes == (64, 64)
    gpu_row = [gpu_local_hit(adapter, tokens(n), configure=_dcp4) for n in PROMPTS]
    assert gpu_row == DCP_GPU_ROW.get(adapter.version, PLUGIN_ROW[adapter.version])
    plugin_row = _row(adapter, CONNECTOR_NAME, configure=_dcp4)
    assert plugin_row == DCP_ROW[adapter.version]
    if adapter.boundary_handoff_patch_needed:
        assert plugin_row == gpu_row
    if support is Support.NATIVE:
        assert plugin_row == _row(adapter, STOCK_CONNECTOR_NAME, configure=_dcp4)
    else:  # the stock 0.26-0.29 connector scales the Mamba group by DCP (256 tokens)
        assert _row(adapter, STOCK_CONNECTOR_NAME, configure=_dcp4) == [0] * len(PROMPTS)


def test_non_hybrid_model_gets_the_stock_scheduler(plugin, adapter):
    """Attention-only KV cache: no refusal on any wheel, and the wheel's own SimpleCPU scheduler class."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

    from hybrid_kv_plugin.connector.simple_cpu import HybridSimpleCPUConnector
    from hybrid_kv_plugin.sim.geometry import ATTENTION_LAYER, build_vllm_config

    # Cache block 16 on every wheel (<= 0.27 take CacheConfig.block_size from the Mamba block).
    geometry = HybridGeometry(mamba_block_size=16)
    vllm_config = build_vllm_config(
        geometry, adapter, kv_connector=CONNECTOR_NAME, kv_connector_extra_config={"cpu_bytes_to_use": 1 << 22}
    )
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float16)
    tensor = make_kv_cache_tensor(adapter, spec.page_size_bytes * 256, [ATTENTION_LAYER], spec.page_size_bytes)
    kv_cache_config = KVCacheConfig(
        num_blocks=256, kv_cache_tensors=[tensor], kv_cache_groups=[KVCacheGroupSpec([ATTENTION_LAYER], spec)]
    )
    register_all_kvcache_specs(vllm_config)
    resolve_block_sizes(adapter, kv_cache_config, vllm_config)
    connector = HybridSimpleCPUConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)

    native = _feature(adapter) is Support.NATIVE
    assert connector.offload_mode is (OffloadMode.NATIVE if native else OffloadMode.STOCK)
    assert type(connector.scheduler_manager) is SimpleCPUOffloadScheduler
    assert connector.get_boundary_store_stats().as_dict() == dict.fromkeys(
        ["published", "stored", "dropped_cpu_full", "dropped_request_gone", "skipped_already_cached",
         "skipped_in_flight", "dropped_null_block", "dropped_not_hashed", "declined_request_end"], 0
    )
