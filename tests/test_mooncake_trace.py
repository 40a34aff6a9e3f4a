"""Mooncake traces: tokens from hash ids, partial last blocks, arrivals from timestamps.

The sample is the first 50 lines of the public Mooncake FAST'25 synthetic trace
(``tests/data/mooncake_sample.jsonl``); the full trace is not needed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybrid_kv_plugin.sim.engine import SAMPLED_TOKEN
from hybrid_kv_plugin.sim.mooncake import BlockTokens, TimedSegment, TraceFormatError, load_mooncake
from hybrid_kv_plugin.sim.workload import ideal_reuse

from scenarios.mooncake_trace import mooncake_line

SAMPLE = Path(__file__).parent / "data" / "mooncake_sample.jsonl"
# Computed by hand from the sample's hash ids (the oracle below), per hash unit.
TOTAL_IDEAL = {16: 29_184, 512: 29_184, 544: 28_832}


def test_shared_ids_give_shared_tokens_and_different_ids_different_tokens():
    (segment,) = load_mooncake([mooncake_line(0, 1536, 2, [0, 1, 2]), mooncake_line(10, 1536, 2, [0, 1, 7])])
    a, b = (list(r.prompt_token_ids) for r in segment.requests)
    assert len(a) == len(b) == 1536
    assert a[:1024] == b[:1024]
    assert a[1024:] != b[1024:]
    # The id is in a block's first two tokens: ids 2 and 7 differ right at position 1024 + 1.
    assert a[1024] == b[1024] and a[1025] != b[1025]


def test_same_id_gives_the_same_tokens_in_every_load_and_position():
    (first,) = load_mooncake([mooncake_line(0, 1024, 1, [5, 9])])
    (second,) = load_mooncake([mooncake_line(0, 1024, 1, [9, 5])])
    tokens1, tokens2 = list(first.requests[0].prompt_token_ids), list(second.requests[0].prompt_token_ids)
    assert tokens1[:512] == tokens2[512:] and tokens1[512:] == tokens2[:512]


def test_partial_last_block_is_a_prefix_of_that_id_block():
    (segment,) = load_mooncake([mooncake_line(0, 1024, 1, [3, 4]), mooncake_line(5, 700, 1, [3, 4])])
    full, partial = (list(r.prompt_token_ids) for r in segment.requests)
    assert len(partial) == 700
    assert partial == full[:700]


def test_timestamps_give_arrival_steps_and_outputs_their_length():
    lines = [mooncake_line(0, 10, 6, [0]), mooncake_line(40, 10, 4, [1]), mooncake_line(277, 10, 92, [2]), mooncake_line(1000, 10, 1, [3])]
    (segment,) = load_mooncake(lines, step_ms=50)
    assert isinstance(segment, TimedSegment)
    assert [r.wave for r in segment.requests] == [0, 0, 5, 20]
    assert [r.max_tokens for r in segment.requests] == [6, 4, 92, 1]
    assert [r.arrival_ms for r in segment.requests] == [0.0, 40.0, 277.0, 1000.0]


def test_trace_block_tokens_changes_the_block_size():
    (segment,) = load_mooncake([mooncake_line(0, 40, 1, [0, 1, 2]), mooncake_line(1, 32, 1, [0, 1])], block_tokens=16)
    a, b = (list(r.prompt_token_ids) for r in segment.requests)
    assert len(a) == 40 and a[:32] == b


def test_sample_file_and_limit():
    with SAMPLE.open() as handle:
        (segment,) = load_mooncake(handle)
    assert len(segment.requests) == 50
    assert sum(len(r.prompt_token_ids) for r in segment.requests) == 699_413
    with SAMPLE.open() as handle:
        (limited,) = load_mooncake(handle, limit=7)
    assert [r.request_id for r in limited.requests] == [f"mc{i}" for i in range(7)]


@pytest.mark.parametrize("unit", [16, 512, 544])
def test_ideal_reuse_matches_the_hash_ids(unit):
    """Oracle from the hash ids alone: a request shares with an earlier one its leading equal
    ids' tokens (capped by both lengths: a partial last block is shared as far as it goes);
    the ideal is the best such share, floored to the unit, leaving one token to compute."""
    with SAMPLE.open() as handle:
        items = [json.loads(line) for line in handle]
    with SAMPLE.open() as handle:
        (segment,) = load_mooncake(handle, conversation_model="blocks")
    ideal = ideal_reuse(segment.requests, unit)
    expected = {}
    for number, item in enumerate(items):
        ids, length = item["hash_ids"], item["input_length"]
        best = 0
        for earlier in items[:number]:
            leading = 0
            for mine, theirs in zip(ids, earlier["hash_ids"]):
                if mine != theirs:
                    break
                leading += 1
            best = max(best, min(leading * 512, length, earlier["input_length"]))
        expected[f"mc{number}"] = min(best, length - 1) // unit * unit
    assert ideal == expected
    assert sum(ideal.values()) == TOTAL_IDEAL[unit]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1], "prio": 2}',
         "trace line 1: unknown key(s) 'prio' for a Mooncake line (allowed: hash_ids, input_length, output_length, timestamp)"),
        (mooncake_line(0, -5, 1, [1]), "trace line 1: input_length must be > 0, got -5"),
        (mooncake_line(0, 10, 0, [1]), "trace line 1: output_length must be > 0, got 0"),
        (mooncake_line(-1, 10, 1, [1]), "trace line 1: timestamp must be a number of ms >= 0, got -1"),
        (mooncake_line(0, 1025, 1, [1, 2]),
         "trace line 1: input_length 1025 needs 3 hash id(s) of 512 tokens, the line has 2 (see --trace-block-tokens)"),
        (mooncake_line(0, 10, 1, ["a"]), "trace line 1: hash_ids must be a list of integers in [0, 1023872003]"),
    ],
)
def test_bad_lines_name_the_line(line, message):
    with pytest.raises(TraceFormatError) as err:
        load_mooncake([line])
    assert str(err.value) == message


def test_a_line_in_the_other_format_is_refused():
    with pytest.raises(TraceFormatError) as err:
        load_mooncake([mooncake_line(0, 10, 1, [1]), '{"tokens": [1, 2, 3]}'])
    assert str(err.value) == (
        "trace line 2: not a Mooncake line (the file mixes formats: its first line is Mooncake)"
    )


# ---------------------------------------------------------------------------- conversation model
def _prompts(lines, model="continuation"):
    (segment,) = load_mooncake(lines, conversation_model=model)
    return [list(r.prompt_token_ids) for r in segment.requests], segment.conversation


def test_continuation_second_turn_is_first_prompt_then_answer_then_own_tokens():
    """Turn 1: 700 tokens (one full block + 188), answer 5. Turn 2 (760 tokens) extends the full
    block: it is turn 1's prompt, the 5 answer tokens the simulator emitted, then 55 of its own."""
    block = BlockTokens(512)
    (first, second), stats = _prompts([mooncake_line(0, 700, 5, [1, 2]), mooncake_line(10, 760, 3, [1, 3])])
    assert first == list(block(1)) + list(block(2)[:188])
    assert second == first + [SAMPLED_TOKEN] * 5 + list(block(3)[705 - 512 : 760 - 512])
    assert (stats.model, stats.continued_requests, stats.answer_tokens) == ("continuation", 1, 5)
    (segment,) = load_mooncake([mooncake_line(0, 700, 5, [1, 2]), mooncake_line(10, 760, 3, [1, 3])])
    assert ideal_reuse(segment.requests, 16) == {"mc0": 0, "mc1": 704}  # 705 shared, floored to 16


def test_blocks_model_gives_the_second_turn_its_own_block():
    block = BlockTokens(512)
    (first, second), stats = _prompts([mooncake_line(0, 700, 5, [1, 2]), mooncake_line(10, 760, 3, [1, 3])], model="blocks")
    assert second == list(block(1)) + list(block(3)[:248])
    assert (stats.model, stats.continued_requests, stats.answer_tokens) == ("blocks", 0, 0)


def test_answer_left_out_where_the_next_input_cannot_hold_it():
    block = BlockTokens(512)
    (first, second), stats = _prompts([mooncake_line(0, 700, 5, [1, 2]), mooncake_line(10, 703, 3, [1, 3])])
    assert second == first + list(block(3)[700 - 512 : 703 - 512])
    assert (stats.continued_requests, stats.answer_tokens) == (1, 0)


def test_only_the_latest_deepest_sharer_ending_in_a_partial_block_is_continued():
    lines = [
        mooncake_line(0, 1024, 2, [1, 2]),  # mc0 ends on a full block: nothing continues it
        mooncake_line(1, 1100, 2, [1, 2, 3]),  # mc1: blocks reading
        mooncake_line(2, 700, 2, [5, 6]),  # mc2: one full block + 188
        mooncake_line(3, 1000, 2, [5, 7]),  # mc3 continues mc2 (shares its one full block)
        mooncake_line(4, 1300, 2, [5, 8, 9]),  # mc4: the latest on block [5] is mc3, not mc2: continues mc3
    ]
    prompts, stats = _prompts(lines)
    block = BlockTokens(512)
    assert prompts[1] == list(block(1)) + list(block(2)) + list(block(3)[:76])
    assert prompts[3][:702] == prompts[2] + [SAMPLED_TOKEN] * 2
    assert prompts[4][:1002] == prompts[3] + [SAMPLED_TOKEN] * 2
    assert (stats.continued_requests, stats.answer_tokens) == (2, 4)


def test_a_continued_block_is_the_block_every_later_request_on_that_path_gets():
    """Equal leading hash ids mean equal leading tokens in both models."""
    prompts, _ = _prompts([mooncake_line(0, 700, 5, [1, 2]), mooncake_line(10, 760, 3, [1, 3]), mooncake_line(20, 1100, 1, [1, 3, 4])])
    first, second, third = prompts
    assert third[:760] == second
    assert third[760:1024] == list(BlockTokens(512)(3)[760 - 512 :])  # the rest of id 3's block
