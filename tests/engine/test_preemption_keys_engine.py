"""mamba_divergence_checkpoint on the real engine: a preempted request's recomputed blocks are keyed again.

Geometry: the engine test's (``ENGINE_GEOMETRY``: attention block 32, Mamba block 32
``align``, prefix-match unit 16); the option on, no connector (the GPU prefix cache only,
so nothing a CPU tier kept from before the preemption can serve the siblings). The engine
runs in a child process (``preemption_keys_scenario.py``).

r0 (a 1,208-token prefix and 150 tokens of its own, 60 greedy answer tokens) is preempted
once its prompt is computed, by ``LLM.reset_prefix_cache(reset_running_requests=True)``
(what an RL weight update calls), recomputes into new blocks and finishes. Siblings r1 and
r2 share the 1,208-token prefix and differ after it. r1's lookup finds r0's attention KV
and no Mamba state at or below 1,200, so its prefill ends a chunk at the divergence it sees
and keeps the state there; r2 resumes at that point. Only if r0's recomputed blocks carry
the unit keys (patch ``divergence_keys_after_preemption``) does r1 see the divergence at
1,200 rather than at the block end 1,184 (measured on 0.32 with the fix made a no-op: r2
resumed at 1,184 and emitted other tokens).

The comparison is like for like: the same requests under another ``cache_salt`` with r0
never preempted. r2's attention KV (r0's prefill from token 0) and its state (r1's) come
from the same chunks either way, so its tokens and logprobs must be bit-identical. A
from-scratch run is no such reference (no single run has both; see
``test_divergence_engine.py``).
"""

from __future__ import annotations

import preemption_keys_scenario as scenario
import pytest
from engine_run import ENGINE_GEOMETRY, child_result, start_in_child

from hybrid_kv_plugin.adapters import select_adapter


@pytest.fixture(scope="module")
def runs(model_dir):
    if not select_adapter().adapter.divergence_checkpoint_supported:
        return {"refusal": start_in_child(model_dir, scenario.ON)}
    return child_result([scenario.__file__, str(model_dir)], scenario.MARKER, timeout_s=1200)


def refused(runs) -> bool:
    """A wheel without the option (none of the engine builds CI runs) refuses it at start-up: asserted."""
    if "refusal" not in runs:
        return False
    assert runs["refusal"]["error"] == "PluginConfigError"
    return True


def test_r0_was_preempted_once_and_finished(runs):
    if refused(runs):
        return
    assert (runs["kept"]["r0"], runs["preempted"]["r0"]) == ([0, scenario.ANSWER], [1, scenario.ANSWER])


def test_the_third_request_resumes_at_the_divergence_point_after_a_preemption(runs):
    if refused(runs):
        return
    unit = ENGINE_GEOMETRY.prefix_match_unit
    divergence = scenario.SHARED // unit * unit
    assert divergence == 1200
    assert runs["preempted"]["hits"] == runs["kept"]["hits"] == [0, divergence]


def test_outputs_equal_the_run_without_a_preemption(runs):
    if refused(runs):
        return
    kept, preempted = runs["kept"]["r2"], runs["preempted"]["r2"]
    assert len(preempted["token_ids"]) == 4  # engine_run.MAX_TOKENS
    assert preempted == kept
