"""The harness reproduces the measured stock baseline (reference §8) on the real wheel.

FA block 16 + Mamba block 64 align, hash 16, stock SimpleCPUOffloadConnector: request A
(4 output tokens), GPU prefix cache reset, then A's prompt + 3 new tokens. The number
is the CPU-tier hit in tokens. This pins the harness to reality before any plugin code
is judged by it.
"""

from __future__ import annotations

import pytest

from helpers import tokens

PROMPTS = (320, 336, 352, 368, 400, 496)
STOCK_CPU_HITS = {
    "0.26.0": (320, 320, 320, 320, 384, 448),
    "0.27.1": (320, 320, 320, 320, 384, 448),
    "0.28.0": (320, 0, 0, 0, 0, 0),
    "0.29.0": (320, 0, 0, 0, 0, 0),
    "0.30.0": (320, 336, 352, 368, 400, 496),
    "0.31.0": (320, 336, 352, 368, 400, 496),
    "0.32.0": (320, 320, 336, 352, 384, 480),
    "0.33.0": (320, 320, 336, 352, 384, 480),
}


@pytest.mark.parametrize("index", range(len(PROMPTS)), ids=[str(p) for p in PROMPTS])
def test_stock_simple_cpu_continuation_hit(no_plugin, make_engine, wheel_version, index):
    prompt = PROMPTS[index]
    engine = make_engine(
        kv_connector="SimpleCPUOffloadConnector", kv_connector_extra_config={"cpu_bytes_to_use": 1 << 22}
    )
    engine.run([("a", tokens(prompt))], max_tokens=4)
    assert engine.reset_prefix_cache()
    hits = engine.run([("b", tokens(prompt) + [3, 4, 5])])
    expected = STOCK_CPU_HITS[wheel_version][index]
    assert hits["b"] == expected
    assert engine.outcomes["b"].external_tokens == expected
