"""The simulated worker's byte check (sim/byte_cache.py): exact on a correct run, fires on a wrong copy.

Every SimEngine runs it; these tests pin what it verified on a CPU-tier replay and feed it
known faults (a load or a store whose bytes go to a neighbour's block, a GPU block that lost
its content) to prove each check can fail.
"""

from __future__ import annotations

import pytest

from hybrid_kv_plugin.adapters import Feature, Support
from hybrid_kv_plugin.sim.byte_cache import describe, make_tags, prefix_hashes

from helpers import tokens
from scenarios.offload import CONTINUATION, cpu_tier_hit, offload_engine

# The CPU-tier hit of A's prompt 352 + 3 tokens (tests/test_cpu_offload_table.py): the
# prompt-tail Mamba state sits at 352 up to 0.31 and at 336 (last boundary <= N-1) from 0.32.
HIT_352 = {"0.32.0": 336, "0.33.0": 336}


@pytest.fixture(autouse=True)
def _fine_grained(adapter):
    assert adapter.verdict(Feature.FINE_GRAINED_CPU_HITS).support is not Support.UNAVAILABLE


def _swap_first_two(meta, field: str) -> None:
    ids = list(getattr(meta, field))
    ids[0], ids[1] = ids[1], ids[0]
    setattr(meta, field, ids)


def _corrupt_metadata(run, field: str, times: int = 1) -> list[int]:
    """The worker sees ``field`` (a copy list of the connector metadata) with its first two ids
    swapped, ``times`` times; the scheduler's own records stay right. Returns the steps hit."""
    connector = run.engine.connector
    original = connector.build_connector_meta
    hit: list[int] = []

    def build_connector_meta(scheduler_output):
        meta = original(scheduler_output)
        if len(hit) < times and len(getattr(meta, field)) >= 2:
            _swap_first_two(meta, field)
            hit.append(len(run.engine.steps))
        return meta

    connector.build_connector_meta = build_connector_meta
    return hit


def test_tags_name_their_content():
    ha = prefix_hashes(tokens(64))
    hb = prefix_hashes(tokens(32) + tokens(32, offset=500))
    assert list(ha[:33]) == list(hb[:33])  # a shared prefix has equal hashes ...
    assert ha[64] != hb[64]  # ... a different one does not
    tags = make_tags(ha, [16, 32, 64], 0)
    assert len(set(tags.tolist())) == 3
    assert describe(int(tags[1])) == "group 0 content up to token 32"
    assert describe(int(make_tags(ha, [64], 1)[0])) == "group 1 content up to token 64"
    assert (describe(0), describe(-1)) == ("zeroed", "a failed load's garbage")


def test_correct_cpu_tier_replay_checks_every_loaded_byte(plugin, adapter):
    run = offload_engine(adapter, byte_check=True)
    hit = cpu_tier_hit(run, tokens(352))
    expected = HIT_352.get(adapter.version, 352)
    assert hit == expected
    cache = run.engine.byte_cache
    assert cache.violations == []
    stats = cache.stats
    # Everything the continuation reuses came from the CPU tier: 16-token attention
    # blocks and the one Mamba state at the hit; its first chunk read them all again.
    assert (stats.loads, stats.loaded_tokens, stats.loaded_attention_blocks, stats.loaded_mamba_states) == (
        1, expected, expected // 16, 1,
    )
    assert (stats.fresh_hits, stats.hit_attention_slots, stats.hit_mamba_states) == (1, expected // 16, 1)


def _what(violations: list[str]) -> list[str]:
    """Each violation's check and position, without the step, request and chunk end."""
    return [v.split(": ", 2)[2].split(":")[0].split("..")[0] for v in violations]


def test_a_load_into_the_neighbours_block_is_caught(plugin, adapter):
    run = offload_engine(adapter, byte_check=True)
    run.request(tokens(352), max_tokens=4)
    assert run.engine.reset_prefix_cache()
    swapped = _corrupt_metadata(run, "load_cpu_blocks")
    with pytest.raises(AssertionError, match="byte check violated") as failure:
        run.request([*tokens(352), *CONTINUATION])
    assert len(swapped) == 1
    hit = HIT_352.get(adapter.version, 352)
    violations = run.engine.byte_cache.violations
    # Attention blocks 0 and 1 swapped: each loaded block is wrong, and the first chunk reads both.
    assert _what(violations) == [
        f"loaded attention block 0 (group 0, hit {hit})",
        f"loaded attention block 1 (group 0, hit {hit})",
        f"attention (group 0) before tokens {hit}",
    ]
    assert "2 wrong" in violations[2]
    assert "holds group 0 content up to token 32, expected group 0 content up to token 16" in violations[0]
    assert str(failure.value).count("\n  ") == 3  # the failure names every violation


# The first store event lists the attention blocks first on 0.26-0.27; from 0.28 the
# prompt-tail Mamba state (a boundary hand-off) comes first.
STORES_ATTENTION_FIRST = ("0.26.0", "0.27.1")


def test_a_store_into_the_neighbours_cpu_block_is_caught(plugin, adapter):
    """The scheduler publishes each copy under its source's keys; the worker wrote the first two
    the other way round (what a copy published under a neighbour's keys looks like)."""
    run = offload_engine(adapter, byte_check=True)
    _corrupt_metadata(run, "store_cpu_blocks")
    run.request(tokens(352), max_tokens=4)
    assert run.engine.reset_prefix_cache()
    with pytest.raises(AssertionError, match="byte check violated"):
        run.request([*tokens(352), *CONTINUATION])
    hit = HIT_352.get(adapter.version, 352)
    violations = run.engine.byte_cache.violations
    if adapter.version in STORES_ATTENTION_FIRST:  # attention blocks 0 and 1 swapped
        assert _what(violations) == [
            f"loaded attention block 0 (group 0, hit {hit})",
            f"loaded attention block 1 (group 0, hit {hit})",
            f"attention (group 0) before tokens {hit}",
        ]
    else:  # the Mamba state and attention block 0 swapped
        assert _what(violations) == [
            f"loaded attention block 0 (group 0, hit {hit})",
            f"loaded Mamba state 5 (group 1, hit {hit})",
            f"attention (group 0) before tokens {hit}",
            f"Mamba state (group 1) read at token {hit}",
        ]
        assert f"holds group 1 content up to token {hit}, expected group 0 content up to token 16" in violations[0]


def test_a_local_prefix_hit_on_a_lost_block_is_caught(plugin, adapter):
    """The GPU prefix cache serves a block whose bytes are gone: the first chunk's read check fires."""
    run = offload_engine(adapter, byte_check=True)
    run.request(tokens(128), max_tokens=1)
    cache = run.engine.byte_cache
    pool = run.engine.gpu_block_pool
    # The cached attention block of tokens 16..32 (group 0) loses its content.
    block = next(b for b in pool.blocks if b.block_hash is not None and cache.gpu[b.block_id, 0].item() ==
                 make_tags(prefix_hashes(tokens(128)), [32], 0)[0])
    cache.gpu[block.block_id] = 0
    with pytest.raises(AssertionError, match="byte check violated"):
        run.request(tokens(128) + [9, 9, 9])
    assert len(cache.violations) == 1
    assert f"block {block.block_id} holds zeroed, expected group 0 content up to token 32" in cache.violations[0]


def test_the_byte_check_can_be_turned_off(plugin, adapter):
    from hybrid_kv_plugin.sim import SimEngine

    engine = SimEngine(adapter=adapter, byte_check=False)
    assert engine.byte_cache is None
    assert engine.run([("a", tokens(64))]) == {"a": 0}




def _fresh_hit_after_b(run):
    """A 278-token request, then B (167 tokens) chunked 64/64/32/7 or 112/48/7 by a 128-token budget
    (B's Mamba state at 160 is cached as a partial tail); B's chunks."""
    engine = run.engine
    engine.add_request("a", tokens(278), max_tokens=1)
    engine.step()
    engine.step()
    engine.add_request("b", tokens(167, offset=500), max_tokens=1)
    engine.run_until_idle()
    return [s.num_scheduled_tokens["b"] for s in engine.steps if "b" in s.num_scheduled_tokens]


def test_chunks_off_the_mamba_grid_leave_a_stale_state(plugin, adapter):
    """A finding of the byte check, pinned: FA 16 + Mamba 64 with CacheConfig.block_size 16 (the
    simulator's geometry from 0.28; a real engine sets it to the Mamba block in align mode) lets a
    128-token step budget run B's second chunk 112..160 across the 128 boundary. Its 128 slot keeps
    the state after 112, which the Mamba manager caches as the state after 128; a later hit at 128
    reads it. Counted apart, not a violation; on 0.26-0.27 (block_size 64) the chunk stops at 128."""
    from hybrid_kv_plugin.sim import HybridGeometry

    run = offload_engine(adapter, geometry=HybridGeometry(max_num_batched_tokens=128))
    assert run.engine.byte_cache is not None  # on by default with the plugin, every wheel
    chunks_of_b = _fresh_hit_after_b(run)
    hit = run.request(tokens(150, offset=500))
    cache = run.engine.byte_cache
    assert cache.violations == []
    if adapter.cache_block_size_is_mamba_block_size:
        assert (chunks_of_b, hit, cache.stats.off_grid_mamba_states) == ([64, 64, 32, 7], 128, 0)
    else:
        assert (chunks_of_b, hit, cache.stats.off_grid_mamba_states) == ([112, 48, 7], 128, 1)


def test_stock_connector_path_hit_holds_every_groups_data(no_plugin, adapter):
    """A vLLM 0.26 bug the byte check found, pinned: with a connector, the 0.26 scheduler takes
    the deepest group's local hit (attention: 144 tokens of B's prefix) although the Mamba group
    holds no state there (128 is its last); nothing loads one, so the request reads the fresh
    Mamba block 34 - B's last attention block, freed - as the state after 144. 0.27 reconciles
    to 128 (the plugin's connector_hit_reconcile does on 0.26: test above)."""
    from hybrid_kv_plugin.connector_names import STOCK_CONNECTOR_NAME
    from hybrid_kv_plugin.sim import HybridGeometry

    geometry = HybridGeometry(max_num_batched_tokens=128)
    default = offload_engine(adapter, STOCK_CONNECTOR_NAME, geometry=geometry)
    # SimEngine runs the byte check by default wherever the wheel as patched serves right bytes.
    assert (default.engine.byte_cache is None) == adapter.connector_lookup_takes_deepest_group
    run = offload_engine(adapter, STOCK_CONNECTOR_NAME, geometry=geometry, byte_check=True)
    _fresh_hit_after_b(run)
    cache = run.engine.byte_cache
    if adapter.connector_lookup_takes_deepest_group:
        with pytest.raises(AssertionError, match="byte check violated"):
            run.request(tokens(150, offset=500))
        assert run.engine.outcomes["r0"].hit_tokens == 144
        assert cache.violations == [
            "step 7: r0: Mamba state (group 1) read at token 144: 1 wrong: block 34 holds group 0 content up "
            "to token 167, expected group 1 content up to token 144"
        ]
        return
    assert run.request(tokens(150, offset=500)) == 128
    assert cache.violations == []


# The bench's EAGLE segment (default_workload's "agents": 15 requests, ideal 4,224 tokens) under
# AsyncScheduler, byte check on: vLLM pads each decode with placeholder drafts, the simulated worker
# accepts none, and the next step starts below what the last one wrote. Per wheel, (steps, reused
# from GPU, reused from CPU) for stock vLLM with its SimpleCPU connector and for the plugin with the
# junction checkpoint.
ASYNC_EAGLE = {
    "0.26.0": {"stock": (89, 2016, 1664), "plugin+junction": (101, 1792, 2048)},
    "0.27.1": {"stock": (89, 1792, 1920), "plugin+junction": (104, 1792, 2064)},
    **{v: {"stock": (99, 768, 1536), "plugin+junction": (99, 960, 2064)} for v in ("0.28.0", "0.29.0")},
    **{v: {"stock": (87, 768, 1536), "plugin+junction": (87, 960, 2064)} for v in ("0.30.0", "0.31.0", "0.32.0", "0.33.0")},
}


def _async_eagle_replay(name: str):
    from hybrid_kv_plugin.sim.configs import CONFIGS
    from hybrid_kv_plugin.sim.replay import ReplaySettings, replay
    from hybrid_kv_plugin.sim.workload import default_workload

    segments = [segment for segment in default_workload(0) if segment.eagle]
    result = replay(segments, ReplaySettings(), CONFIGS[name], observe=False, per_request=False)
    assert result.ideal_tokens == 4_224
    return result.steps, result.reused_gpu_tokens, result.reused_cpu_tokens


@pytest.mark.parametrize("scheduling", ["async"], indirect=True)
def test_rejected_drafts_leave_the_accepted_state(adapter, scheduling):
    assert {name: _async_eagle_replay(name) for name in ("stock", "plugin+junction")} == ASYNC_EAGLE[adapter.version]


# Without the draft model, the step at which agent0-root's own decode reads a slot and state one token "ahead"
# (tokens 450..452, content up to 451). 0.26.0 replays this segment without it (its rejected drafts never
# leave a partly filled slot or state behind here).
TOKEN_AHEAD_STEP = {"0.26.0": None, "0.27.1": 5, "0.28.0": 5, "0.29.0": 5} | dict.fromkeys(("0.30.0", "0.31.0", "0.32.0", "0.33.0"), 4)


@pytest.mark.parametrize("scheduling", ["async"], indirect=True)
def test_without_the_draft_model_the_check_sees_a_token_ahead(adapter, scheduling, monkeypatch):
    from hybrid_kv_plugin.sim.byte_cache import ByteCache

    # The byte model as it was (the simulator's code, not vLLM's): the rejected draft's position looks written.
    monkeypatch.setattr(ByteCache, "_reject_drafts", lambda self, req_id, table, start, h: None)
    step = TOKEN_AHEAD_STEP[adapter.version]
    if step is None:
        assert _async_eagle_replay("stock") == ASYNC_EAGLE[adapter.version]["stock"]
        return
    with pytest.raises(AssertionError) as failure:
        _async_eagle_replay("stock")
    assert (
        f"step {step}: agent0-root: Mamba state (group 1) read at token 450: 1 wrong: " in str(failure.value)
        and "holds group 1 content up to token 451, expected group 1 content up to token 450" in str(failure.value)
    )


# After a step without the request, its next chunk starts where the scheduler says: the runner takes
# rejected drafts off a start only while the request's previous batch is undelivered. `plugin-junction`
# (the soak's EAGLE variant) under AsyncScheduler, seed 7 (steps, byte-checked loads on 0.30.0): with the
# rewind counted two deep, q67 starts again at 221 over positions 221..223 already written. Seed 1
# (q16 at step 179) showed it first, until the CPU tier's EAGLE tail (offload/admission.py) moved its
# run; seeds 0 and 3-10 show it too. Every wheel runs the seed clean.
ASYNC_EAGLE_GAP_SEED = (7, 10_017, 175)


@pytest.mark.parametrize("scheduling", ["async"], indirect=True)
def test_a_step_without_the_request_ends_the_draft_lead(plugin, adapter, scheduling, monkeypatch):
    from hybrid_kv_plugin.sim.byte_cache import ByteCache
    from soak.harness import soak, soak_pinned, variants

    variant = next(v for v in variants(adapter) if v.name == "plugin-junction")
    if not soak_pinned(adapter, variant, ASYNC_EAGLE_GAP_SEED, adapter.version == "0.30.0"):
        return
    seed = ASYNC_EAGLE_GAP_SEED[0]
    # The byte model as it was (the simulator's code, not vLLM's): the rewind after the gap looks two deep.
    monkeypatch.setattr(ByteCache, "_undelivered_drafts", lambda self, req_id: 0)
    _, _, violations = soak(adapter, variant, 10_000, seed)
    assert violations[:2] == [
        "step 656: q67: attention (group 0) before tokens 221..223: 1 wrong: block 16 holds group 0 content up to "
        "token 223, expected group 0 content up to token 221",
        "step 656: q67: Mamba state (group 1) read at token 221: 1 wrong: block 19 holds group 1 content up to "
        "token 223, expected group 1 content up to token 221",
    ]
