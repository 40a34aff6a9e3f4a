"""``replay --tier-ceiling``: what a CPU tier of a given size can keep of a workload's reuse, in a
block model (sim/tier_ceiling.py): LRU, the offline optimum (Belady), the tier each order needs per reuse
goal. Hand-built workloads whose figures follow from the rules, then the command."""

from __future__ import annotations

import io
import json

import pytest

from hybrid_kv_plugin.cli.report import render_report
from hybrid_kv_plugin.sim.tier_ceiling import tier_ceiling
from hybrid_kv_plugin.sim.workload import Segment, TraceRequest

from scenarios.mooncake_trace import mooncake_line, run_replay, write_trace

BLOCK = 4


def _request(name: str, tokens: list[int], answer: int = 1) -> TraceRequest:
    return TraceRequest(request_id=name, wave=0, prompt_token_ids=tuple(tokens), max_tokens=answer)


def _one_block(token: int) -> list[int]:
    """A prompt of one whole block of ``token`` plus the token left to compute."""
    return [token] * BLOCK + [99]


def _figures(segments, tier_blocks):
    c = tier_ceiling(segments, BLOCK, tier_blocks)
    return c.ideal_tokens, c.lru_tokens, c.offline_tokens, c.lru_blocks_for, c.offline_blocks_for


def test_the_offline_order_keeps_what_lru_cycles_out():
    # Three one-block prefixes, then the first two again, on a two-block tier: LRU evicts each
    # just before it is used; the offline order never admits the third (never used again).
    p, q, r = _one_block(1), _one_block(2), _one_block(3)
    seg = Segment("cycle", tuple(_request(f"r{i}", t) for i, t in enumerate((p, q, r, p, q))))
    assert _figures([seg], 2) == (8, 0, 8, {0.90: 3, 0.95: 3}, {0.90: 2, 0.95: 2})
    assert _figures([seg], 3)[:3] == (8, 8, 8)
    assert _figures([seg], 0)[:3] == (8, 0, 0)
    # One block: the optimum keeps p for its use and passes over q (needed later): half the ideal.
    assert _figures([seg], 1)[:3] == (8, 0, 4)


def test_the_offline_order_passes_over_a_block_needed_later():
    # On a one-block tier, q arrives while p is needed twice before q is: the offline order
    # does not admit q (it loses q's one use and keeps p's two), LRU cycles both out.
    p, q = _one_block(1), _one_block(2)
    seg = Segment("bypass", tuple(_request(f"r{i}", t) for i, t in enumerate((p, q, p, p, q))))
    assert _figures([seg], 1) == (12, 4, 8, {0.90: 2, 0.95: 2}, {0.90: 2, 0.95: 2})


def test_lru_evicts_a_prefix_from_its_tail():
    # A two-block prompt, another prompt, the first again, on a two-block tier: LRU drops the
    # first prompt's second block, not its root, and still serves one block of it.
    a = [1] * BLOCK + [2] * BLOCK + [99]
    seg = Segment("tail", (_request("a", a), _request("b", _one_block(3)), _request("a2", a)))
    assert _figures([seg], 2) == (8, 4, 8, {0.90: 3, 0.95: 3}, {0.90: 2, 0.95: 2})


def test_a_next_turn_reuses_the_answer_blocks():
    # Turn 1: 5 prompt tokens and a 4-token answer, 9 tokens, 2 whole blocks; turn 2 repeats all
    # of them and adds its own: 2 blocks reusable, one of them the answer's.
    from hybrid_kv_plugin.sim.engine import SAMPLED_TOKEN

    turn1 = [1, 1, 1, 1, 7]
    turn2 = turn1 + [SAMPLED_TOKEN] * 4 + [5, 5, 5, 5]
    seg = Segment("chat", (_request("t1", turn1, answer=4), _request("t2", turn2)))
    assert _figures([seg], 8)[:3] == (8, 8, 8)
    # A one-token answer leaves the second block unfilled: one block reusable.
    seg = Segment("chat", (_request("t1", turn1, answer=1), _request("t2", turn2)))
    assert _figures([seg], 8)[:3] == (4, 4, 4)


def test_each_segment_starts_with_an_empty_tier():
    p = _one_block(1)
    segments = [Segment("one", (_request("a", p), _request("b", p))), Segment("two", (_request("c", p),))]
    assert _figures(segments, 8)[:3] == (4, 4, 4)


def test_a_negative_tier_is_refused():
    with pytest.raises(ValueError, match="tier_blocks >= 0"):
        tier_ceiling([], BLOCK, -1)


# ---------------------------------------------------------------------------- the command
def _chat_trace(tmp_path):
    # Turn 2 continues turn 1 (700-token prompt, 5-token answer): 705 shared tokens, 44 whole
    # 16-token blocks, and the embedded geometry's attention block is the unit (16).
    return write_trace(tmp_path, [mooncake_line(0, 700, 5, [1, 2]), mooncake_line(5, 760, 3, [1, 3])])


def test_the_report_carries_the_ceiling(tmp_path, capsys):
    code, out, _ = run_replay(capsys, "--trace", _chat_trace(tmp_path), "--configs", "stock", "--tier-ceiling", "--json")
    assert code == 0
    report = json.loads(out)
    # The model's ideal is the replay's where the attention block is the prefix-match unit.
    assert report["results"][0]["ideal_tokens"] == 704
    assert report["tier_ceiling"] == {
        "model": "attention blocks only, requests in arrival order, a fresh tier per segment",
        "block_tokens": 16,
        "tier_blocks": report["settings"]["cpu_blocks"],
        "ideal_tokens": 704,
        "lru_tokens": 704,
        "lru_efficiency": 1.0,
        "offline_tokens": 704,
        "offline_efficiency": 1.0,
        # LRU keeps turn 1's first N blocks (its tail goes first): 0.90 of 704 needs 40 blocks, 0.95 needs 42.
        "lru_blocks_for": {"0.90": 40, "0.95": 42},
        # Turn 1's 44 blocks are all needed at turn 2, the deeper ones no sooner: the optimum keeps the first N too.
        "offline_blocks_for": {"0.90": 40, "0.95": 42},
    }
    text = io.StringIO()
    render_report(report, text)  # what the command prints without --json
    tier = report["settings"]["cpu_blocks"]
    assert text.getvalue().endswith(
        f"\nCPU tier ceiling (a block model of this workload: {tier:,} blocks of 16 tokens, attention only, "
        "requests one after another; ideal 704 tokens)\n"
        "  LRU keeps 1.000 of it, the offline optimum (Belady) 1.000\n"
        "  LRU keeps 0.90 from 40 blocks and 0.95 from 42 blocks\n"
        "  the offline optimum keeps 0.90 from 40 blocks and 0.95 from 42 blocks\n"
    )


def test_heavy_tier_evictions_point_at_the_ceiling(capsys):
    # The embedded workload on a 40-block tier: evictions cost stock a share of its ideal well past a
    # tenth, so the report names --tier-ceiling; asked for, the ceiling replaces the hint.
    code, out, _ = run_replay(capsys, "--configs", "stock", "--cpu-blocks", "40", "--json")
    assert code == 0
    report = json.loads(out)
    stock = report["results"][0]
    share = stock["loss"]["evicted"] / stock["ideal_tokens"]
    assert share >= 0.10
    assert report["next_steps"] == [
        f"CPU-tier evictions cost stock {share:.1%} of the ideal: --tier-ceiling shows what a tier of this size can "
        "keep of this workload and the tier that keeps 0.90 / 0.95 of it (--cpu-gib or cpu_bytes_to_use sets the size)"
    ]
    code, out, _ = run_replay(capsys, "--configs", "stock", "--cpu-blocks", "40", "--tier-ceiling", "--json")
    assert code == 0
    report = json.loads(out)
    assert "next_steps" not in report
    c = report["tier_ceiling"]
    assert (c["ideal_tokens"], c["lru_efficiency"], c["offline_efficiency"], c["lru_blocks_for"], c["offline_blocks_for"]) == (
        7824, 0.54, 0.785, {"0.90": 83, "0.95": 88}, {"0.90": 59, "0.95": 70}
    )
    # The model's ideal is the replay's here too (attention block = unit = 16).
    assert report["results"][0]["ideal_tokens"] == 7824


def test_the_ceiling_is_not_for_several_engines(tmp_path, capsys):
    code, out, err = run_replay(capsys, "--trace", _chat_trace(tmp_path), "--engines", "2", "--tier-ceiling")
    assert (code, out) == (2, "")
    assert err == "hybrid-kv: --tier-ceiling models the CPU tier of one engine; it does not apply with --engines\n"
