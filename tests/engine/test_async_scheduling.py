"""The engine suite's main sequence under ``AsyncScheduler``, the scheduler a GPU ``vllm serve`` runs by default.

vLLM's CPU platform turns ``async_scheduling`` off for every engine ("async scheduling
is not required on CPU"). This module's engine keeps it on through a test-only override
of that one switch (``CpuPlatform.check_and_update_config`` runs unchanged, then the
requested value is put back); with it the CPU engine runs ``AsyncScheduler`` and its
batch queue (measured: the same tokens and logprobs as ``Scheduler`` on a 448-token
prompt). Then the sequence of ``test_engine_outputs`` (cold, GPU replay, CPU-tier replay
after ``reset_prefix_cache()``, continuation) runs on it: hits must be the simulator's
under async, and every output equal its like-for-like reference computed by the same
engine, token for token and logprob for logprob.
"""

from __future__ import annotations

import contextlib

import pytest
from engine_run import ENGINE_GEOMETRY, assert_outputs_match_references, async_scheduling_kept, running_llm
from sim_prediction import predict
from test_engine_outputs import LENGTHS, PHASES, engine_side, request_sequence, run_sequence


@pytest.fixture(scope="module")
def async_llm(model_dir):
    with contextlib.ExitStack() as running:
        with async_scheduling_kept():
            engine = running.enter_context(running_llm(model_dir, ENGINE_GEOMETRY, async_scheduling=True))
        yield engine


@pytest.fixture(scope="module")
def async_runs(async_llm):
    return run_sequence(async_llm)


def test_the_engine_runs_the_async_scheduler(async_llm):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    core = async_llm.llm_engine.engine_core.engine_core
    assert async_llm.llm_engine.vllm_config.scheduler_config.async_scheduling is True
    assert type(core.scheduler) is AsyncScheduler
    assert core.batch_queue_size == 2


def test_hits_and_outputs_under_async(async_runs):
    steps = request_sequence()
    predicted = iter(predict(ENGINE_GEOMETRY, [(a, t) for a, _, _, t in steps], async_scheduling=True))
    sim_hits = {(n, phase): next(predicted) for action, phase, n, _ in steps if action == "run"}
    engine = {key: (run.num_cached_tokens, run.external_hits) for key, run in async_runs.items() if key in sim_hits}
    assert len(engine) == len(LENGTHS) * len(PHASES)
    assert engine == {key: engine_side(sim_hits, *key) for key in sim_hits}
    for n in LENGTHS:
        assert_outputs_match_references(async_runs, n, ("gpu", "cpu", "continuation"))
    # The same hits as under Scheduler (test_engine_outputs asserts those against its engine).
    sync = predict(ENGINE_GEOMETRY, [(a, t) for a, _, _, t in steps], async_scheduling=False)
    assert [(h.hit, h.external) for h in sync] == [(h.hit, h.external) for h in sim_hits.values()]
