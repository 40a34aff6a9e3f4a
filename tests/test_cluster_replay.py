"""Replay of a cluster (``hybrid-kv replay --engines N``): N real schedulers, each with its own
GPU cache, behind a router, with per-engine CPU tiers or one shared store tier.

Geometry: Qwen3-Next's (attention and Mamba block 544, align mode), prefix-match unit 16,
the plugin's connector. A Mooncake line's hash ids stand for 512-token blocks."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hybrid_kv_plugin.adapters import select_adapter
from hybrid_kv_plugin.sim.cluster import ClusterInputError, replay_cluster, route, session_parents
from hybrid_kv_plugin.sim.configs import CONFIGS
from hybrid_kv_plugin.sim.mooncake import load_mooncake
from hybrid_kv_plugin.sim.replay import ReplaySettings, replay

from scenarios.mooncake_trace import mooncake_line, run_replay, write_trace

SETTINGS = ReplaySettings(attention_block_size=544, mamba_block_size=544, hash_block_size=16, gpu_blocks=64, cpu_blocks=64)
PLUGIN = CONFIGS["plugin"]


# A: 1,000 tokens; B (5 s later) shares A's two blocks and goes on; C shares A's first block.
SHARED_PREFIX = [mooncake_line(0, 1000, 4, [1, 2]), mooncake_line(5000, 1400, 4, [1, 2, 3]), mooncake_line(10000, 1100, 4, [1, 7, 8])]
# Another request, then a chat: turn 1, and turn 2 (= turn 1 + its answer + new text).
CHAT = [mooncake_line(0, 1000, 4, [40, 41]), mooncake_line(100, 1000, 4, [1, 2]), mooncake_line(5000, 1400, 4, [1, 9, 10])]


def _segment(lines):
    return load_mooncake(lines)[0]


def _hits(result):
    return {rid: (row["engine"], row["reused"], row["cpu"], row["cpu_other"]) for rid, row in result.per_request.items()}


# ---------------------------------------------------------------------------- shared vs per-engine tiers
def test_a_prefix_computed_on_engine_a_is_a_hit_on_engine_b_only_through_the_shared_tier():
    segment = _segment(SHARED_PREFIX)
    assignment = route(3, 2, "round-robin")
    assert assignment == [0, 1, 0]
    own = replay_cluster(segment, SETTINGS, PLUGIN, engines=2, tier="per-engine", assignment=assignment, per_request=True)
    shared = replay_cluster(segment, SETTINGS, PLUGIN, engines=2, tier="shared", assignment=assignment, per_request=True)
    # B (engine 1) reuses A's 992 tokens (1,000 floored to the unit, one token left to
    # compute) only from the store, all written by engine 0; per-engine tiers give nothing.
    assert _hits(own) == {"mc0": (0, 0, 0, 0), "mc1": (1, 0, 0, 0), "mc2": (0, 0, 0, 0)}
    assert _hits(shared) == {"mc0": (0, 0, 0, 0), "mc1": (1, 992, 992, 992), "mc2": (0, 0, 0, 0)}
    assert own.as_dict()["hits_by_source"] == {"own_gpu": 0, "own_cpu": 0, "other_engine_cpu": 0}
    assert shared.as_dict()["hits_by_source"] == {"own_gpu": 0, "own_cpu": 0, "other_engine_cpu": 992}
    assert (shared.ideal_tokens, shared.reused_tokens) == (1504, 992)
    assert (own.cpu_blocks_per_engine, shared.cpu_blocks_total) == (64, 128)
    assert shared.unattributed_blocks == 0
    # Per engine: B's efficiency is 1.0 (992 of its 992), A's engine reuses nothing of its 512.
    assert [(e.requests, e.ideal_tokens, e.reused_tokens) for e in shared.per_engine] == [(2, 512, 0), (1, 992, 992)]


def test_the_byte_check_verifies_bytes_one_engine_loads_from_what_another_stored():
    segment = _segment(SHARED_PREFIX)
    shared = replay_cluster(
        segment, SETTINGS, PLUGIN, engines=2, tier="shared", assignment=[0, 1, 0], byte_check=True
    )
    # The check ran (violations would have raised): engine 1 loaded once, from engine 0's bytes.
    assert [e.byte_loads for e in shared.per_engine] == [0, 1]


def test_a_load_waits_for_the_other_engines_store_to_complete():
    # B arrives one step (50 ms) after A. A's stores take 2 steps to complete: B finds nothing
    # published yet and computes its prompt. With stores done in the step they are issued, A's
    # first attention block (stored in that step, engine 0 stepping before engine 1) is there.
    segment = _segment([mooncake_line(0, 1000, 4, [1, 2]), mooncake_line(50, 1400, 4, [1, 2, 3])])
    slow = replace(SETTINGS, transfer_delay_steps=2)
    late = replay_cluster(segment, slow, PLUGIN, engines=2, tier="shared", assignment=[0, 1], per_request=True)
    assert _hits(late) == {"mc0": (0, 0, 0, 0), "mc1": (1, 0, 0, 0)}
    prompt = replay_cluster(segment, SETTINGS, PLUGIN, engines=2, tier="shared", assignment=[0, 1], per_request=True)
    assert _hits(prompt) == {"mc0": (0, 0, 0, 0), "mc1": (1, 544, 544, 544)}


# On 0.26 (its connector lookup takes the deepest group) the CPU-tier hit is counted with the GPU
# cache's, by the single-engine replay and the cluster alike (the total is right): (992, 0), not (544, 448).
_OWN_SPLIT = (992, 0) if select_adapter().adapter.connector_lookup_takes_deepest_group else (544, 448)


def test_one_engine_is_the_single_engine_replay():
    segment = _segment(SHARED_PREFIX)
    single = replay([segment], SETTINGS, PLUGIN).summary()
    for tier in ("per-engine", "shared"):
        one = replay_cluster(segment, SETTINGS, PLUGIN, engines=1, tier=tier, assignment=[0, 0, 0]).as_dict()
        assert (one["reused_tokens"], one["steps"]) == (single["reused_tokens"], single["steps"]) == (992, 20)
        assert (one["hits_by_source"]["own_gpu"], one["hits_by_source"]["own_cpu"]) == (
            single["reused_gpu_tokens"], single["reused_cpu_tokens"],
        ) == _OWN_SPLIT


# ---------------------------------------------------------------------------- routing
def test_session_parents_follow_the_continuation_model():
    segment = _segment(CHAT)
    assert segment.conversation.continued_requests == 1
    parents = session_parents(([[40, 41], 1000], [[1, 2], 1000], [[1, 9, 10], 1400]), 512)
    assert parents == [-1, -1, 1]
    assert route(3, 2, "session", parents) == [0, 1, 1]
    assert route(3, 2, "round-robin") == [0, 1, 0]


def test_session_routing_keeps_a_conversation_on_one_engine():
    segment = _segment(CHAT)
    parents = [-1, -1, 1]
    # Round-robin puts turn 2 on engine 0: with per-engine tiers it finds nothing there.
    # Session routing keeps it on engine 1, with turn 1's prompt and answer.
    rr = replay_cluster(
        segment, SETTINGS, PLUGIN, engines=2, tier="per-engine", assignment=route(3, 2, "round-robin"), per_request=True
    )
    sessions = replay_cluster(
        segment, SETTINGS, PLUGIN, engines=2, tier="per-engine", assignment=route(3, 2, "session", parents),
        router="session", per_request=True,
    )
    assert _hits(rr)["mc2"] == (0, 0, 0, 0)
    assert _hits(sessions)["mc2"] == (1, 992, _OWN_SPLIT[1], 0)
    assert sessions.as_dict()["hits_by_source"]["other_engine_cpu"] == 0


def test_session_routing_needs_conversations():
    with pytest.raises(ClusterInputError, match="no request continues another"):
        route(3, 2, "session", [-1, -1, -1])


# ---------------------------------------------------------------------------- the command
GEOMETRY_FLAGS = ("--attention-block-size", "544", "--mamba-block-size", "544", "--prefix-match-unit", "16",
                  "--gpu-blocks", "64", "--cpu-blocks", "64")


def test_the_command_reports_per_engine_and_cluster_reuse_by_source(tmp_path, capsys):
    trace = write_trace(tmp_path, SHARED_PREFIX)
    code, out, err = run_replay(capsys, "--trace", trace, "--engines", "2", "--baseline", "--json", *GEOMETRY_FLAGS)
    assert code == 0, err
    report = json.loads(out)
    rows = {row["run"]: row for row in report["results"]}
    assert list(rows) == ["baseline", "per-engine", "shared"]
    assert rows["baseline"]["cpu_blocks_per_engine"] == 128  # one engine, the two tiers' sum
    assert [rows[r]["reused_tokens"] for r in rows] == [992, 0, 992]
    assert rows["shared"]["hits_by_source"] == {"own_gpu": 0, "own_cpu": 0, "other_engine_cpu": 992}
    assert (rows["per-engine"]["reuse_over_baseline"], rows["shared"]["reuse_over_baseline"]) == (0.0, 1.0)
    code, out, _ = run_replay(capsys, "--trace", trace, "--engines", "2", "--cpu-tier", "shared", *GEOMETRY_FLAGS)
    assert code == 0
    assert "vLLM" in out and "  engine 1" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--engines", "0"), "hybrid-kv: --engines must be >= 1, got 0"),
        (("--engines", "1", "--router", "session"), "hybrid-kv: --router, --cpu-tier and --baseline apply to --engines N > 1"),
        (("--engines", "2", "--cpu-tier", "store"), "hybrid-kv: --cpu-tier 'store': allowed: per-engine, shared"),
        (("--engines", "2", "--router", "session"),
         "hybrid-kv: --router session needs a trace with conversations (no request continues another)"),
        (("--engines", "2", "--cold-replay"), "hybrid-kv: --cold-replay is not available with --engines N > 1"),
    ],
)
def test_bad_cluster_input_is_one_line_exit_2(tmp_path, capsys, argv, message):
    trace = write_trace(tmp_path, SHARED_PREFIX)
    code, out, err = run_replay(capsys, "--trace", trace, *argv, *GEOMETRY_FLAGS)
    assert (code, out, err) == (2, "", message + "\n")


def test_an_unknown_router_and_a_missing_trace_are_one_line_exit_2(capsys):
    code, out, err = run_replay(capsys, "--engines", "2", "--router", "foo")
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "--router: invalid choice: 'foo'" in err
    code, out, err = run_replay(capsys, "--engines", "2")
    assert (code, out, err) == (
        2, "", "hybrid-kv: --engines N > 1 replays a Mooncake trace (--trace FILE.jsonl): its timestamps clock the engines\n"
    )
