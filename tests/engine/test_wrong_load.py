"""Test 2: the output comparison of test 1 catches a wrong Mamba state loaded from the CPU tier.

The test-only copy stand-in lets a test corrupt one load on purpose: here the first
linear-attention layer's recurrent state block is read from the CPU block that holds
the second layer's state at the same position (the rest of the load is faithful).
The hit count is unchanged, so only the outputs can tell.
"""

from __future__ import annotations

import random

import hybrid_kv_test_copy_standin as standin
import pytest
from engine_run import ENGINE_GEOMETRY, generate, like_for_like
from sim_prediction import predict

LENGTH = 472  # CPU-tier hit 464 on 0.32: ends off the Mamba grid, served from a boundary state
# A wrong state moves a logprob by more than this (bf16 noise between chunkings stays under 0.1).
WRONG_STATE_MIN_SHIFT = 0.15


def prompt() -> list[int]:
    rng = random.Random("wrong-load")
    return [rng.randrange(3, 1024) for _ in range(LENGTH)]


def mamba_groups_first(llm) -> int:
    """Loads list blocks group by group; this model's groups are 3 Mamba layers, then attention."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    kinds = [type(group.kv_cache_spec).__name__ for group in scheduler.kv_cache_config.kv_cache_groups]
    assert kinds == ["MambaSpec", "MambaSpec", "MambaSpec", "FullAttentionSpec"]
    return 3


@pytest.fixture
def wrong_mamba_state(llm):
    def first_layer_reads_second_layers_state(cpu_blocks: list[int], gpu_blocks: list[int]) -> list[int]:
        # One block per Mamba group (only the hit's boundary state is loaded), first.
        return [cpu_blocks[1], *cpu_blocks[1:]]

    standin.LOAD_FAULT = first_layer_reads_second_layers_state
    yield
    standin.LOAD_FAULT = None
    # The wrong state now sits in the GPU prefix cache: keep it from any later test. A
    # one-token request first lets the engine step once more and finish the faulty
    # run's CPU stores (reset_prefix_cache() refuses while their blocks are pinned).
    generate(llm, [7] * 16, cache_salt="wrong-load-drain", max_tokens=1)
    assert llm.reset_prefix_cache()


def replay_from_cpu_tier(llm):
    generate(llm, prompt())
    # A second run lets the engine step once more, completing the first run's CPU
    # stores: reset_prefix_cache() refuses while their blocks are still pinned.
    generate(llm, prompt())
    assert llm.reset_prefix_cache()
    loads_before = len(standin.LOADS)
    run = generate(llm, prompt())
    assert len(standin.LOADS) == loads_before + 1
    return run, standin.LOADS[-1]


def predicted_cpu_tier_hit() -> tuple[int, int]:
    """(hit, external) the simulator predicts for the replay (the plugin is registered: ``llm``)."""
    *_, replay = predict(ENGINE_GEOMETRY, [("run", prompt()), ("run", prompt()), ("reset", []), ("run", prompt())])
    return replay.hit, replay.external


def test_same_replay_without_the_fault_is_exact(llm):
    """The control: the same prompt, a faithful load, identical outputs."""
    assert standin.LOAD_FAULT is None
    run, (cpu_blocks, _) = replay_from_cpu_tier(llm)
    reference = like_for_like(llm, prompt(), prompt(), run.num_cached_tokens, salt="wrong-load-reference-2")
    assert (run.num_cached_tokens, run.external_hits) == predicted_cpu_tier_hit()
    assert run.num_cached_tokens > 0
    assert len(set(cpu_blocks)) == len(cpu_blocks)
    assert (run.token_ids, run.logprobs) == (reference.token_ids, reference.logprobs)


def test_wrong_mamba_state_changes_outputs(llm, wrong_mamba_state):
    mamba_groups = mamba_groups_first(llm)
    run, (cpu_blocks, gpu_blocks) = replay_from_cpu_tier(llm)
    hit = run.num_cached_tokens
    reference = like_for_like(llm, prompt(), prompt(), hit, salt="wrong-load-reference")

    assert (hit, run.external_hits) == predicted_cpu_tier_hit()
    assert hit > 0
    # 3 Mamba boundary states + the attention blocks of the hit (464 -> 15 on 0.32), the first state wrong.
    assert len(gpu_blocks) == mamba_groups + -(-hit // 32)
    assert cpu_blocks[0] == cpu_blocks[1]
    # What test 1 asserts fails, by far more than bf16 rounding.
    assert (run.token_ids, run.logprobs) != (reference.token_ids, reference.logprobs)
    assert max(abs(a - b) for a, b in zip(run.logprobs, reference.logprobs)) > WRONG_STATE_MIN_SHIFT
