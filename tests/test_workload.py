"""Workloads and the loss attribution's arithmetic: hand-made traces and facts with known answers."""

from __future__ import annotations

import json

import pytest

from hybrid_kv_plugin.sim.attribution import Admission, Bucket, Fate, MambaGrid, fate_of_step, split_loss
from hybrid_kv_plugin.sim.engine import SAMPLED_TOKEN
from hybrid_kv_plugin.sim.workload import (
    Segment,
    TraceRequest,
    default_workload,
    ideal_reuse,
    load_trace,
    prefix_keys,
    with_eagle,
    workload_of_size,
)


def req(rid: str, tokens, max_tokens: int = 1, wave: int = 0) -> TraceRequest:
    return TraceRequest(rid, wave, tuple(tokens), max_tokens)


# ---------------------------------------------------------------------------- ideal reuse
def test_ideal_is_the_longest_shared_prefix_floored_to_the_hash_unit():
    a = req("a", range(1, 41))  # 40 tokens
    b = req("b", [*range(1, 38), 900, 901, 902, 903, 904])  # shares 37 tokens with a
    assert ideal_reuse([a, b], 16) == {"a": 0, "b": 32}
    assert ideal_reuse([a, b], 4) == {"a": 0, "b": 36}


def test_ideal_leaves_one_token_to_compute():
    a = req("a", range(1, 33))  # 32 tokens
    again = req("again", range(1, 33))  # the very same prompt
    longer = req("longer", range(1, 50))
    assert ideal_reuse([a, again, longer], 16) == {"a": 0, "again": 16, "longer": 32}


def test_ideal_counts_the_generated_answer_of_earlier_requests():
    first = req("t0", range(1, 21), max_tokens=5)  # history: 20 prompt + 5 sampled tokens
    second = req("t1", [*range(1, 21), *([SAMPLED_TOKEN] * 5), *range(500, 510)])
    assert ideal_reuse([first, second], 4) == {"t0": 0, "t1": 24}
    assert ideal_reuse([first, second], 16) == {"t0": 0, "t1": 16}


def test_ideal_takes_the_best_of_all_earlier_requests_in_list_order():
    system = list(range(1, 65))
    a = req("a", [*system[:20], *range(700, 740)])
    b = req("b", [*system, *range(800, 840)])
    c = req("c", [*system, *range(900, 930)])
    d = req("d", [*system[:40], *range(600, 630)])
    assert ideal_reuse([a, b, c, d], 16) == {"a": 0, "b": 16, "c": 64, "d": 32}
    # List order, not waves, decides what is "earlier".
    assert ideal_reuse([c, b], 16) == {"c": 0, "b": 64}


def test_prefix_keys_identify_whole_unit_prefixes():
    keys = prefix_keys(list(range(1, 40)), 16)
    assert len(keys) == 2
    assert keys == prefix_keys(list(range(1, 33)) + [0] * 5, 16)
    assert prefix_keys(list(range(1, 40)), 16)[0] != prefix_keys([0, *range(2, 40)], 16)[0]


# ---------------------------------------------------------------------------- embedded workload
def test_default_workload_shape_is_fixed():
    chat, agents = default_workload()
    assert (chat.name, chat.eagle, len(chat.requests)) == ("chat", False, 16)
    assert (agents.name, agents.eagle, len(agents.requests)) == ("agents", True, 15)
    assert [len(r.prompt_token_ids) for r in chat.requests[:4]] == [300, 250, 150, 300]
    assert sum(r.evict_gpu_before for r in chat.requests) == 8
    assert sum(r.evict_gpu_before for r in agents.requests) == 3
    assert ideal_reuse(chat.requests, 16)["conv3-t1"] == 304
    assert default_workload() == default_workload()
    assert default_workload(seed=1) != default_workload()


def test_scaled_workloads():
    assert sum(len(s.requests) for s in default_workload(scale=3)) == 93
    assert sum(len(s.requests) for s in workload_of_size(2000)) == 2015
    forced = with_eagle(default_workload(), False)
    assert [s.eagle for s in forced] == [False, False]
    assert with_eagle(default_workload(), None) == default_workload()


# ---------------------------------------------------------------------------- traces
def lines(*items) -> list[str]:
    return [json.dumps(i) for i in items]


def test_trace_forms_and_segments():
    segments = load_trace(
        lines(
            {"id": "a", "tokens": [5, 6, 7], "max_tokens": 2},
            {"id": "b", "prefix_id": "sys", "prefix_len": 40, "suffix_len": 3, "segment": "agents", "eagle": True},
            {"id": "c", "prefix_id": "sys", "prefix_len": 30, "suffix_len": 5, "segment": "agents", "wave": 9},
            {"id": "d", "continues": "a", "suffix_len": 4, "evict_gpu_before": True},
        )
    )
    assert [(s.name, s.eagle, [r.request_id for r in s.requests]) for s in segments] == [
        ("main", None, ["a", "d"]),
        ("agents", True, ["b", "c"]),
    ]
    a, d = segments[0].requests
    b, c = segments[1].requests
    assert (a.wave, a.max_tokens, a.prompt_token_ids) == (1, 2, (5, 6, 7))
    assert d.prompt_token_ids[:5] == (5, 6, 7, SAMPLED_TOKEN, SAMPLED_TOKEN) and len(d.prompt_token_ids) == 9
    assert (d.wave, d.evict_gpu_before) == (4, True)
    assert (len(b.prompt_token_ids), len(c.prompt_token_ids), c.wave) == (43, 35, 9)
    assert b.prompt_token_ids[:30] == c.prompt_token_ids[:30]
    assert b.prompt_token_ids[30] != c.prompt_token_ids[30]
    assert load_trace(lines({"prefix_id": "sys", "prefix_len": 40, "suffix_len": 3})) == load_trace(
        lines({"prefix_id": "sys", "prefix_len": 40, "suffix_len": 3})
    )


@pytest.mark.parametrize(
    ("items", "message"),
    [
        ([{"id": "a"}], "trace line 1: 'suffix_len'"),
        ([{"id": "a", "tokens": []}], "trace line 1: empty prompt"),
        ([{"id": "a", "tokens": [1]}, {"id": "a", "tokens": [2]}], "trace line 2: duplicate id 'a'"),
        ([{"id": "b", "continues": "x", "suffix_len": 2}], "trace line 1: continues 'x': no earlier line has that id"),
        ([{"tokens": [1], "eagle": "yes"}], "trace line 1: eagle must be true or false"),
        (
            [{"tokens": [1], "eagle": True}, {"tokens": [2], "eagle": False}],
            "trace line 2: segment 'main' mixes eagle true and false",
        ),
        ([{"tokens": [1], "max_tokens": 0}], "trace line 1: max_tokens must be >= 1"),
        ([[1, 2]], "trace line 1: each line must be a JSON object"),
        (
            [{"tokens": [1]}, {"tokens": [2], "max_token": 4}],
            "trace line 2: unknown key(s) 'max_token' (allowed: continues, eagle, evict_gpu_before, id, max_tokens, "
            "prefix_id, prefix_len, segment, suffix_len, tokens, wave)",
        ),
    ],
)
def test_trace_errors_name_the_line(items, message):
    with pytest.raises(ValueError) as err:
        load_trace(lines(*items))
    assert str(err.value) == message


# ---------------------------------------------------------------------------- attribution arithmetic
def facts(**kw) -> Admission:
    base = dict(
        ideal=320, reused=0, grid=0, grid_fate=Fate.UNKNOWN, served=0, misaligned=False, eagle_drop=0,
        cpu_evicted_before=False,
    )
    base.update(kw)
    return Admission(**base)


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({}, {Bucket.NO_MAMBA_STATE: 320}),
        ({"reused": 320, "grid": 320, "served": 320}, {}),
        ({"reused": 288, "grid": 288, "served": 288}, {Bucket.NO_MAMBA_STATE: 32}),
        # A state at 256 existed: what happened to its offload decides.
        ({"grid": 256, "grid_fate": Fate.UNKNOWN}, {Bucket.NO_MAMBA_STATE: 64, Bucket.HANDOFF_DROPPED: 256}),
        (
            {"grid": 256, "grid_fate": Fate.UNKNOWN, "cpu_evicted_before": True},
            {Bucket.NO_MAMBA_STATE: 64, Bucket.EVICTED: 256},
        ),
        ({"grid": 256, "grid_fate": Fate.KEPT}, {Bucket.NO_MAMBA_STATE: 64, Bucket.EVICTED: 256}),
        ({"grid": 256, "grid_fate": Fate.DROPPED}, {Bucket.NO_MAMBA_STATE: 64, Bucket.HANDOFF_DROPPED: 256}),
        ({"grid": 256, "grid_fate": Fate.CPU_FULL}, {Bucket.NO_MAMBA_STATE: 64, Bucket.CPU_POOL_FULL: 256}),
        # Partly served: only the part above the reuse is lost.
        ({"reused": 128, "served": 128, "grid": 256, "grid_fate": Fate.KEPT}, {Bucket.NO_MAMBA_STATE: 64, Bucket.EVICTED: 128}),
        # The CPU tier held 304 beyond a misaligned local hit of 272 that the connector skipped.
        ({"reused": 272, "served": 304, "grid": 304, "misaligned": True}, {Bucket.NO_MAMBA_STATE: 16, Bucket.MISALIGNED_LOCAL_PREFIX: 32}),
        ({"reused": 272, "served": 304, "grid": 304}, {Bucket.NO_MAMBA_STATE: 16, Bucket.UNEXPLAINED: 32}),
        # EAGLE: the top block is out of reach first, then the walk goes on from 304.
        ({"reused": 304, "served": 304, "grid": 304, "eagle_drop": 16}, {Bucket.EAGLE_PRUNE: 16}),
        ({"eagle_drop": 16}, {Bucket.EAGLE_PRUNE: 16, Bucket.NO_MAMBA_STATE: 304}),
        ({"grid": 304, "grid_fate": Fate.KEPT, "eagle_drop": 16}, {Bucket.EAGLE_PRUNE: 16, Bucket.EVICTED: 304}),
        ({"reused": 312, "eagle_drop": 16}, {Bucket.EAGLE_PRUNE: 8}),
        # Reuse above the ideal loses nothing.
        ({"reused": 336}, {}),
    ],
)
def test_split_loss_puts_every_lost_token_in_one_bucket(kw, expected):
    f = facts(**kw)
    buckets = split_loss(f)
    assert buckets == expected
    assert sum(buckets.values()) == max(f.ideal - f.reused, 0)


def test_grid_keeps_the_first_fate_unless_a_store_is_seen_later():
    grid = MambaGrid()
    keys = prefix_keys(list(range(1, 100)), 16)  # 6 units
    grid.add(keys[1], Fate.DROPPED)
    grid.add(keys[3], Fate.CPU_FULL)
    assert grid.best(keys, 6) == (4, Fate.CPU_FULL)
    assert grid.best(keys, 3) == (2, Fate.DROPPED)
    assert grid.best(keys, 1) == (0, Fate.UNKNOWN)
    grid.add(keys[1], Fate.CPU_FULL)
    assert grid.best(keys, 3) == (2, Fate.DROPPED)
    grid.add(keys[1], Fate.KEPT)
    assert grid.best(keys, 3) == (2, Fate.KEPT)
    assert len(grid) == 2


@pytest.mark.parametrize(
    ("growth", "fate"),
    [
        (None, Fate.UNKNOWN),
        ({"published": 2, "stored": 2}, Fate.KEPT),
        ({"published": 1, "skipped_already_cached": 1}, Fate.KEPT),
        ({"published": 3, "stored": 1, "dropped_cpu_full": 2}, Fate.CPU_FULL),
        ({"published": 1, "dropped_request_gone": 1}, Fate.DROPPED),
        ({"published": 2, "stored": 1, "dropped_null_block": 1}, Fate.KEPT),
        ({}, Fate.KEPT),
    ],
)
def test_fate_of_a_step_from_the_connector_counters(growth, fate):
    assert fate_of_step(growth) is fate


def test_segment_is_plain_data():
    segment = Segment("x", (req("a", [1, 2]),), eagle=True)
    assert segment.requests[0].history() == (1, 2, SAMPLED_TOKEN)
