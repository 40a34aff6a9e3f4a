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
from engine_run import generate
from test_engine_outputs import CONTINUATION_LOGPROB_TOLERANCE

LENGTH = 472  # CPU-tier hit 464: ends off the Mamba grid, served from a boundary state


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


def test_same_replay_without_the_fault_is_exact(llm):
    """The control: the same prompt, a faithful load, identical outputs."""
    assert standin.LOAD_FAULT is None
    run, (cpu_blocks, _) = replay_from_cpu_tier(llm)
    uncached = generate(llm, prompt(), cache_salt="wrong-load-uncached-2")
    assert (run.num_cached_tokens, run.external_hits) == (464, 464)
    assert len(set(cpu_blocks)) == len(cpu_blocks)
    assert (run.token_ids, run.logprobs) == (uncached.token_ids, uncached.logprobs)


def test_wrong_mamba_state_changes_outputs(llm, wrong_mamba_state):
    mamba_groups = mamba_groups_first(llm)
    run, (cpu_blocks, gpu_blocks) = replay_from_cpu_tier(llm)
    uncached = generate(llm, prompt(), cache_salt="wrong-load-uncached")

    assert (run.num_cached_tokens, run.external_hits) == (464, 464)
    # 3 Mamba boundary states + 15 attention blocks (464 / 32 rounded up), the first state wrong.
    assert len(gpu_blocks) == mamba_groups + 15
    assert cpu_blocks[0] == cpu_blocks[1]
    assert uncached.num_cached_tokens == 0
    # What test 1 asserts fails, and by more than even its continuation tolerance.
    assert (run.token_ids, run.logprobs) != (uncached.token_ids, uncached.logprobs)
    assert max(abs(a - b) for a, b in zip(run.logprobs, uncached.logprobs)) > CONTINUATION_LOGPROB_TOLERANCE
