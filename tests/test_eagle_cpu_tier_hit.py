"""Under EAGLE, what the CPU tier serves against what the GPU prefix cache serves, per wheel.

EAGLE drops the last matched block of a prefix hit (the drafter needs the target's
hidden state there, which only recomputing it gives). From 0.27 the SimpleCPU tier's
coordinator drops it as the GPU one does (vLLM PR #49071). 0.26 builds that coordinator
without EAGLE, so its CPU tier serves one block deeper; the plugin does not backport the
flag: 0.26's coordinator would drop a whole Mamba block there, not one prefix-match unit
as 0.27+ do (the default workload's reuse fell from 0.9468 to 0.9305 with it). Target
outputs are the same either way (the target verifies every draft).

Real scheduler and connectors of every wheel, the 64-token grid: A's prompt of 300 tokens
and 30 answer tokens (its decode keeps the Mamba state at 320), then B = A's prompt +
answer + 3 new tokens, from the GPU cache or, after a GPU reset, from the CPU tier.
"""

from __future__ import annotations

import pytest

from hybrid_kv_plugin.connector_names import CONNECTOR_NAME, STOCK_CONNECTOR_NAME
from hybrid_kv_plugin.sim.engine import SAMPLED_TOKEN
from hybrid_kv_plugin.sim.geometry import HybridGeometry
from hybrid_kv_plugin.sim.wheel import eagle_block_drop_options

from helpers import tokens
from scenarios.offload import CONTINUATION, cpu_tier_hit, gpu_local_hit, offload_engine

PROMPT = tokens(300)
ANSWER = 30
REPLAY = [*PROMPT, *[SAMPLED_TOKEN] * ANSWER, *CONTINUATION]
# Attention holds B's prefix to 320, EAGLE drops that block: the Mamba state below 256 is at 192.
GPU_HIT = 192
CPU_HIT = {"0.26.0": 320}  # the block EAGLE drops, and the state at 320, served from the CPU tier


def _geometry(adapter) -> HybridGeometry:
    return HybridGeometry(
        attention_block_size=64, mamba_block_size=64, hash_block_size=64, eagle=True,
        extra_speculative_config=eagle_block_drop_options(adapter),
    )


@pytest.mark.parametrize("connector", [STOCK_CONNECTOR_NAME, CONNECTOR_NAME])
def test_cpu_tier_hit_against_the_gpu_hit(plugin, adapter, connector):
    geometry = _geometry(adapter)
    assert gpu_local_hit(adapter, PROMPT, geometry=geometry, max_tokens=ANSWER, replay=REPLAY) == GPU_HIT
    run = offload_engine(adapter, connector, geometry=geometry)
    hit = cpu_tier_hit(run, PROMPT, max_tokens=ANSWER, replay=REPLAY)
    assert hit == CPU_HIT.get(adapter.version, GPU_HIT)
