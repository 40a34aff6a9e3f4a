"""vLLM's prompt-tail Mamba state under AsyncScheduler (patch ``prompt_tail_keyed_once``).

Request a (80 tokens: five 16-token units, inside the second 64-token Mamba block)
leaves vLLM's prompt-tail state at 80 on 0.26-0.31 (0.32+ keep theirs at 64, the
last boundary <= 79). Under ``AsyncScheduler`` stock vLLM keys a second copy of it
one step late, after a's first decode wrote the state after 81 tokens into the
block. A 300-token filler then takes the free blocks up to and including the right
copy, which was freed first; b (a's prompt plus 20 tokens) hits 80 and the forward
pass reads the state after 81 (the byte-moving simulator on the wheel's real
scheduler). The plugin keys the state once: b finds the 64-token state, and reads
what that hit promises.
"""

from __future__ import annotations

import random

import pytest

from hybrid_kv_plugin.sim.byte_cache import describe
from hybrid_kv_plugin.sim.geometry import HybridGeometry

PROMPT = [random.Random(0).randrange(1, 30_000) for _ in range(100)]
FILLER = [random.Random(1).randrange(1, 30_000) for _ in range(300)]
A_LENGTH = 80


def _run(make_engine, with_filler=True):
    """a, the filler, b; the ends of the Mamba states the prefix cache keyed after a, b's hit, the violations."""
    engine = make_engine(HybridGeometry(attention_block_size=64, mamba_block_size=64, hash_block_size=16, num_gpu_blocks=12))
    engine.add_request("a", PROMPT[:A_LENGTH], max_tokens=4)
    engine.run_until_idle()
    cache = engine.byte_cache
    ((mamba_group, _),) = cache.mamba
    tags = [int(cache.gpu[block.block_id, 0]) for block in engine.gpu_block_pool.blocks if block.block_hash is not None]
    keyed = sorted(describe(tag) for tag in tags if tag > 0 and tag & 0xF == mamba_group)
    if with_filler:
        engine.add_request("filler", FILLER, max_tokens=1)
        engine.run_until_idle()
    engine.add_request("b", PROMPT, max_tokens=2)
    while engine.has_work():
        engine.step()
    return keyed, engine.outcomes["b"].hit_tokens, cache.violations


def _states(*ends):
    return sorted(f"group 1 content up to token {end}" for end in ends)


def test_under_scheduler_one_state_is_keyed(no_plugin, make_engine, adapter):
    keyed, hit, violations = _run(make_engine)
    if adapter.native_prompt_tail_keyed_after_its_chunk:
        assert (keyed, hit, violations) == (_states(64, 80), 80, [])
    else:
        assert (keyed, hit, violations) == (_states(64), 64, [])


@pytest.mark.parametrize("scheduling", ["async"], indirect=True)
def test_stock_async_keys_the_state_after_81_tokens_as_80s(no_plugin, make_engine, adapter):
    keyed, hit, violations = _run(make_engine)
    if not adapter.native_prompt_tail_keyed_after_its_chunk:
        assert (keyed, hit, violations) == (_states(64), 64, [])
        return
    assert (keyed, hit) == (_states(64, 80, 81), 80)
    assert len(violations) == 1
    assert violations[0].endswith(
        "b: Mamba state (group 1) read at token 80: 1 wrong: block 2 holds group 1 content up to token 81, "
        "expected group 1 content up to token 80"
    )


@pytest.mark.parametrize("scheduling", ["async"], indirect=True)
def test_plugin_async_keys_it_once(plugin, make_engine, adapter):
    keyed, hit, violations = _run(make_engine)
    # The filler took the only state at 80: b resumes from 64, and reads 64's state.
    expected = _states(64, 80) if adapter.native_prompt_tail_keyed_after_its_chunk else _states(64)
    assert (keyed, hit, violations) == (expected, 64, [])


@pytest.mark.parametrize("scheduling", ["async"], indirect=True)
def test_plugin_async_keeps_the_hit_at_80(plugin, make_engine, adapter):
    _, hit, violations = _run(make_engine, with_filler=False)
    assert (hit, violations) == (80 if adapter.native_prompt_tail_keyed_after_its_chunk else 64, [])
