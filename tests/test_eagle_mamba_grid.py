"""EAGLE + Mamba ``align``: every cached Mamba slot holds the state at its block's end (patches/mamba_split_keeps_block_grid.py).

On the real scheduler of every wheel, prefix caching on, no connector: P caches A's first
Mamba block; X and A then share one step's token budget, so A's first chunk (from its hit
at 64) ends mid-block at 102. vLLM 0.26 lets A's next chunk run on to the prompt's end,
past 128, so its slot 1 keeps the state after 102 tokens and is cached as the state at
128; B, which shares A's prompt and answer, resumes there. The byte-checking worker
(``sim/byte_cache.py``) reads what B's forward pass reads.
"""

from __future__ import annotations

import dataclasses

from hybrid_kv_plugin.sim.engine import SAMPLED_TOKEN, SimEngine
from hybrid_kv_plugin.sim.geometry import HybridGeometry
from hybrid_kv_plugin.sim.wheel import eagle_block_drop_options

from helpers import tokens

BLOCK = 64
# A's prompt chunks (start, tokens). 0.26 with the patch: the budget-limited chunk ends at 102,
# the next one stops at 128. 0.27+ floor a prompt chunk's end to the grid instead (vLLM PR
# #51113): A waits a step and runs 64..128. 0.26 as shipped: 102..156 crosses 128 holding 102.
A_CHUNKS = [(64, 38), (102, 26), (128, 28)]
NATIVE_A_CHUNKS = [(64, 92)]
ABLATED_A_CHUNKS = [(64, 38), (102, 54)]
# B's attention hit is 192, less EAGLE's last block: 128, where 0.26 keeps A's state; 0.27+ keep
# none there (A's one chunk passed 128 without ending in it), so B resumes at 64.
B_HIT = 128
NATIVE_B_HIT = 64


def _run(adapter) -> tuple[list[tuple[int, int]], int, list[str]]:
    geometry = HybridGeometry(
        attention_block_size=BLOCK, mamba_block_size=BLOCK, hash_block_size=BLOCK, num_gpu_blocks=64,
        max_num_batched_tokens=128, max_num_seqs=8, max_model_len=1024, eagle=True,
        extra_speculative_config=eagle_block_drop_options(adapter),
    )
    engine = SimEngine(geometry, adapter=adapter)
    prompt_a = tokens(156)
    engine.run([("p", prompt_a[:130])])  # its first chunk ends at 64 and caches that state (A's hit)
    engine.add_request("x", tokens(90, offset=2000), max_tokens=1)
    engine.add_request("a", prompt_a, max_tokens=40)  # its answer fills attention blocks up to 192
    chunks = []
    while engine.has_work():
        record = engine.step()
        if "a" in record.num_scheduled_tokens and engine.scheduler.requests.get("a") is not None:
            num = record.num_scheduled_tokens["a"]
            start = engine.scheduler.requests["a"].num_computed_tokens - num
            if start < len(prompt_a):
                chunks.append((start, num))
    engine.add_request("b", prompt_a + [SAMPLED_TOKEN] * 40 + tokens(20, offset=3000))
    while engine.has_work():
        engine.step()
    return chunks, engine.outcomes["b"].hit_tokens, list(engine.byte_cache.violations)


def test_a_mid_block_chunk_stops_at_the_block_end(plugin, adapter):
    chunks, hit, violations = _run(adapter)
    if adapter.mamba_split_aligns_below_cache_limit_only:
        assert (chunks, hit, violations) == (A_CHUNKS, B_HIT, [])
    else:
        assert (chunks, hit, violations) == (NATIVE_A_CHUNKS, NATIVE_B_HIT, [])


def test_without_the_stop_b_resumes_from_a_truncated_state(plugin, adapter, monkeypatch):
    from hybrid_kv_plugin.patches import mamba_split_keeps_block_grid

    installed = any(spec.name == "mamba_split_keeps_block_grid" for spec in plugin.patch_set.specs)
    assert installed == adapter.mamba_split_aligns_below_cache_limit_only  # 0.26 only
    if not installed:
        return
    monkeypatch.setattr(mamba_split_keeps_block_grid, "block_end_stop", lambda scheduler, request, start, end: None)
    chunks, hit, violations = _run(adapter)
    assert (chunks, hit) == (ABLATED_A_CHUNKS, B_HIT)
    assert violations == [
        "step 45: b: Mamba state (group 1) read at token 128: 1 wrong: block 4 holds group 1 content up to token 102, "
        "expected group 1 content up to token 128"
    ]
