"""Under EAGLE the CPU tier serves the prefix the GPU prefix cache would (patches/cpu_lookup_follows_eagle.py).

EAGLE drops the last matched block of a prefix hit (its draft KV there was computed
before the next token was known). vLLM 0.26 builds the SimpleCPU tier's coordinator
without EAGLE, so a prefix replayed from the CPU tier got what the GPU prefix cache
drops. Real scheduler and connectors of every wheel, the 64-token grid: A's prompt of 300
tokens and 30 answer tokens (its decode keeps the Mamba state at 320), then B = A's prompt
+ answer + 3 new tokens, from the GPU cache or, after a GPU reset, from the CPU tier.
"""

from __future__ import annotations

import pytest

from hybrid_kv_plugin.connector_names import CONNECTOR_NAME, STOCK_CONNECTOR_NAME
from hybrid_kv_plugin.sim.geometry import HybridGeometry
from hybrid_kv_plugin.sim.wheel import eagle_block_drop_options

from hybrid_kv_plugin.sim.engine import SAMPLED_TOKEN, SimEngine

from helpers import tokens
from scenarios.offload import CONTINUATION, offload_engine

PROMPT = tokens(300)
ANSWER = 30
REPLAY = [*PROMPT, *[SAMPLED_TOKEN] * ANSWER, *CONTINUATION]
# Attention holds B's prefix to 320, EAGLE drops that block: the Mamba state below 256 is at 192.
GPU_HIT = 192
ABLATED_CPU_HIT = 320  # 0.26 as shipped: the CPU tier keeps EAGLE's last block (and the state at 320)


def _geometry(adapter) -> HybridGeometry:
    return HybridGeometry(
        attention_block_size=64, mamba_block_size=64, hash_block_size=64, eagle=True,
        extra_speculative_config=eagle_block_drop_options(adapter),
    )


def _cpu_tier_hit(adapter, connector: str, geometry: HybridGeometry) -> int:
    run = offload_engine(adapter, connector, geometry=geometry)
    run.request(PROMPT, max_tokens=ANSWER)
    assert run.engine.reset_prefix_cache()
    hit = run.request(REPLAY)
    run.invariants.check()
    return hit


@pytest.mark.parametrize("connector", [STOCK_CONNECTOR_NAME, CONNECTOR_NAME])
def test_cpu_tier_hit_equals_the_gpu_hit(plugin, adapter, connector):
    geometry = _geometry(adapter)
    gpu = SimEngine(geometry, adapter=adapter)
    gpu.run([("a", PROMPT)], max_tokens=ANSWER)
    assert gpu.run([("b", REPLAY)])["b"] == GPU_HIT
    assert _cpu_tier_hit(adapter, connector, geometry) == GPU_HIT


@pytest.mark.parametrize("connector", [STOCK_CONNECTOR_NAME, CONNECTOR_NAME])
def test_without_the_patch_the_cpu_tier_keeps_eagles_last_block(plugin, adapter, connector, monkeypatch):
    from hybrid_kv_plugin.patches import cpu_lookup_follows_eagle

    installed = any(spec.name.startswith("cpu_lookup_follows_eagle") for spec in plugin.patch_set.specs)
    assert installed == adapter.simplecpu_lookup_ignores_eagle  # 0.26 only
    if not installed:
        return
    monkeypatch.setattr(cpu_lookup_follows_eagle, "engine_runs_eagle", lambda vllm_config: False)
    assert _cpu_tier_hit(adapter, connector, _geometry(adapter)) == ABLATED_CPU_HIT
