"""mamba_divergence_checkpoint: the Mamba state kept where a request's cached attention prefix ends, without EAGLE.

Real Scheduler (and AsyncScheduler), KVCacheManager and HybridSimpleCPUConnector of
the installed wheel. Three requests share a long prefix and differ after it. Request
2 finds attention KV for the whole prefix (request 1's blocks) and no Mamba state in
it past request 1's Mamba states (a block end, or none): its ``shared_prefix_boundary``
(the junction) is where its attention hit ends. Without the option the wheel keeps no
Mamba state there (its stop is floored to the grid, and the Mamba manager keeps only
the prompt tail), and with attention blocks as coarse as the Mamba block the lookup
does not even see a divergence inside a block; with it, attention blocks are keyed at
every prefix-match unit, request 2's prefill ends a chunk at the junction and keeps
the state, so request 3 resumes at the divergence point - from the GPU prefix cache,
or from the CPU tier after the GPU prefix cache is reset. When request 2's attention hit
is on the CPU tier only (GPU cache reset before it too), the connector sets the point from
the tier's lookup.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import pytest

from hybrid_kv_plugin.adapters import ADAPTERS, first_wheel_where
from hybrid_kv_plugin.config import PluginConfigError, check_divergence_supported
from hybrid_kv_plugin.connector_names import CONNECTOR_NAME
from hybrid_kv_plugin.divergence import MANAGER_ATTR
from hybrid_kv_plugin.sim import HybridGeometry, SimEngine
from hybrid_kv_plugin.sim.invariants import OffloadInvariants
from hybrid_kv_plugin.sim.wheel import junction_active

from helpers import LogRecords, record_admission_counts, recording, tokens
from scenarios.prompt_tail import mamba_states_held

ON = {"hybrid_kv": {"mamba_divergence_checkpoint": True}}
OFF = {"hybrid_kv": {"mamba_divergence_checkpoint": False}}
CPU_BYTES = 4096 * 2048

# Prefix-match unit 16. Qwen3-Next's geometry (attention block = Mamba block = 544, as
# align mode sets them), and attention block 32 under a Qwen3-Next-like Mamba block (544)
# or a small one (64). Each shared prefix ends inside a Mamba block.
QWEN3_NEXT = HybridGeometry(attention_block_size=544, mamba_block_size=544, hash_block_size=16)
FA32_MAMBA544 = HybridGeometry(attention_block_size=32, mamba_block_size=544, hash_block_size=16, num_gpu_blocks=512)
FA32_MAMBA64 = HybridGeometry(attention_block_size=32, mamba_block_size=64, hash_block_size=16, num_gpu_blocks=512)
CASES = {
    "qwen3-next-1216": (QWEN3_NEXT, 1216),
    "qwen3-next-1000": (QWEN3_NEXT, 1000),
    "fa32-mamba544": (FA32_MAMBA544, 1216),
    "fa32-mamba64": (FA32_MAMBA64, 1248),
}
SUFFIX = 100


def _supported(adapter) -> bool:
    return adapter.divergence_checkpoint_supported


def _refused_here(adapter, build) -> bool:
    """On a wheel without the option, building with it stops start-up (asserted): True, nothing more to run."""
    if _supported(adapter):
        return False
    with pytest.raises(PluginConfigError, match=r"hybrid_kv\.mamba_divergence_checkpoint: true needs vLLM >= "):
        build()
    return True


@dataclass(frozen=True)
class Siblings:
    """``hits``: each request's hit (tokens it did not compute); ``external``: request 3's CPU-tier part.
    ``junction``: request 2's ``shared_prefix_boundary``; ``chunks``: request 2's prefill chunks.
    ``mamba_states``: Mamba blocks with a prefix-cache key once request 2 finished;
    ``stored``: Mamba boundary states the connector stored by then.
    ``cpu_pins``: CPU-tier blocks still pinned once request 3 finished.
    ``unexpected``: vLLM warnings that the lookup recorded a CPU hit the scheduler did not take."""

    hits: tuple[int, int, int]
    external: int
    junction: int
    chunks: tuple[int, ...]
    mamba_states: int
    stored: int
    cpu_pins: int
    unexpected: int


def siblings(adapter, geometry: HybridGeometry, shared: int, config: dict, *, reset_gpu: bool,
             reset_before_second: bool = False) -> Siblings:
    """``reset_gpu``: the GPU prefix cache is reset before request 3; ``reset_before_second``:
    before request 2 too (its attention hit is then on the CPU tier only)."""
    with recording("vllm") as vllm_log:
        return _siblings(adapter, geometry, shared, config, reset_gpu, reset_before_second, vllm_log)


def _siblings(adapter, geometry: HybridGeometry, shared: int, config: dict, reset_gpu: bool,
              reset_before_second: bool, vllm_log: LogRecords) -> Siblings:
    engine = SimEngine(
        geometry,
        adapter=adapter,
        kv_connector=CONNECTOR_NAME,
        kv_connector_extra_config={"cpu_bytes_to_use": CPU_BYTES},
        additional_config=config,
    )
    invariants = OffloadInvariants(engine)
    prefix = tokens(shared)
    requests, chunks, states, stored = [], (), 0, 0
    for k in range(3):
        if k == 1 and reset_before_second:
            assert engine.reset_prefix_cache(), "the GPU prefix cache must be resettable once idle"
        if k == 2:
            states = mamba_states_held(engine)
            stored = engine.connector.get_boundary_store_stats().stored
            if reset_gpu:
                assert engine.reset_prefix_cache(), "the GPU prefix cache must be resettable once idle"
        first = len(engine.steps)
        requests.append(engine.add_request(f"r{k}", prefix + tokens(SUFFIX, 2000 + 150 * k), max_tokens=2))
        engine.run_until_idle()
        invariants.check()
        if k == 1:
            chunks = tuple(
                step.num_scheduled_tokens["r1"]
                for step in engine.steps[first:]
                if "r1" in step.num_scheduled_tokens
            )[:-1]  # the last entry is the decode step
    hits = tuple(engine.outcomes[f"r{k}"].hit_tokens for k in range(3))
    cpu_pins = sum(block.ref_cnt for block in engine.connector.scheduler_manager.cpu_block_pool.blocks)
    unexpected = sum("unexpectedly recorded" in message for message in vllm_log.messages(logging.WARNING))
    return Siblings(hits, engine.outcomes["r2"].external_tokens, requests[1].shared_prefix_boundary, chunks, states,
                    stored, cpu_pins, unexpected)


# Per case: request 2's junction and request 3's hit, without the option (stock) and with it.
# Qwen3-Next: attention blocks keyed only at block ends show request 2 no divergence inside
# a block (junction 0 with a Mamba state at 1088; with only attention to 544 at 1000); the
# option keys them at every unit, so request 2 sees the divergence to the unit and keeps the
# state there. Attention block 32: request 2 sees it either way, but only the option keeps
# a state there (stock keeps none in between: request 2's chunk ended at the junction).
# Measured identical on 0.29 (junction backport) and 0.30-0.33 (the wheel's own junction stop
# and manager case, gate opened by the plugin).
STOCK = {"qwen3-next-1216": (0, 1088), "qwen3-next-1000": (544, 544), "fa32-mamba544": (1216, 0), "fa32-mamba64": (1248, 0)}
DIVERGENCE = {
    "qwen3-next-1216": (1216, 1216), "qwen3-next-1000": (992, 992), "fa32-mamba544": (1216, 1216), "fa32-mamba64": (1248, 1248),
}
# Request 2's hit (the same either way: the option serves the request after it).
SECOND_HIT = {"qwen3-next-1216": 1088, "qwen3-next-1000": 0, "fa32-mamba544": 0, "fa32-mamba64": 0}
# Request 2's prefill chunks (stock, option) and the Mamba blocks holding a reusable state
# once it finished (= stored on the CPU tier). The cost: one chunk where the wheel did not
# already end one at the divergence point, and one Mamba block per diverging request.
CHUNKS = {
    "qwen3-next-1216": ((224, 4), (128, 96, 4)),
    "qwen3-next-1000": ((544, 544, 12), (544, 448, 96, 12)),
    "fa32-mamba544": ((1216, 96, 4), (1216, 96, 4)),
    "fa32-mamba64": ((1248, 96, 4), (1248, 96, 4)),
}
STATES = {"qwen3-next-1216": (3, 4), "qwen3-next-1000": (3, 4), "fa32-mamba544": (2, 3), "fa32-mamba64": (3, 4)}
# 0.30+ (the wheel's own junction stop): the exact junction replaces the wheel's stop at the
# junction floored to the Mamba grid (544), so neither a chunk nor a state is added there (the
# state at 992 replaces the one at 544); the 0.29 backport keeps every stop the wheel makes.
NATIVE = {"qwen3-next-1000": ((992, 96, 12), 3)}


@pytest.mark.both_schedulers
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("tier", ["gpu", "cpu"])
def test_third_request_resumes_at_the_divergence_point(plugin, adapter, case, tier):
    geometry, shared = CASES[case]
    if _refused_here(adapter, lambda: siblings(adapter, geometry, shared, ON, reset_gpu=tier == "cpu")):
        return
    stock = siblings(adapter, geometry, shared, OFF, reset_gpu=tier == "cpu")
    kept = siblings(adapter, geometry, shared, ON, reset_gpu=tier == "cpu")
    (stock_junction, stock_hit), (junction, hit) = STOCK[case], DIVERGENCE[case]
    assert junction == shared // 16 * 16  # the divergence point, unit-floored
    assert (stock.junction, kept.junction) == (stock_junction, junction)
    assert stock.hits == (0, SECOND_HIT[case], stock_hit)
    assert kept.hits == (0, SECOND_HIT[case], hit)
    # The scheduler declines a CPU hit a kept local sub-block tail already covers (GPU tier
    # kept): the connector unpins it without vLLM's per-request warning; nothing stays pinned.
    assert (stock.cpu_pins, kept.cpu_pins, stock.unexpected, kept.unexpected) == (0, 0, 0, 0)
    if tier == "cpu":
        # After the GPU prefix cache reset, all of it comes from the CPU tier.
        assert (stock.external, kept.external) == (stock_hit, hit)


# The GPU prefix cache reset before request 2 as well: its attention hit is on the CPU tier
# only. The wheel sets the divergence point from the GPU lookup alone (junction 0); the
# connector moves it to the tier's attention reach (divergence/cpu_tier.py), so request 2
# keeps the state there and request 3 resumes at the divergence point from the CPU tier.
# Request 2 itself resumes where it would anyway (0, or the tier's Mamba state at 1,088).
CPU_ONLY_STOCK = {"qwen3-next-1216": 1088, "qwen3-next-1000": 0, "fa32-mamba544": 0, "fa32-mamba64": 0}
# States stored by the end of request 2 (without, with the option): the one at the point, plus
# the Mamba block end request 2's chunk at the point starts a new block at (fa32-mamba64), and
# 0.29's backport keeping the wheel's own stop at 544 as well (qwen3-next-1000, 0.30+: 3).
CPU_ONLY_STORED = {"qwen3-next-1216": (3, 4), "qwen3-next-1000": (2, 4), "fa32-mamba544": (2, 3), "fa32-mamba64": (2, 4)}
CPU_ONLY_NATIVE_STORED = {"qwen3-next-1000": (2, 3)}


@pytest.mark.both_schedulers
@pytest.mark.parametrize("case", sorted(CASES))
def test_cpu_tier_only_hit_sets_the_divergence_point(plugin, adapter, case):
    geometry, shared = CASES[case]
    build = lambda config: siblings(adapter, geometry, shared, config, reset_gpu=True, reset_before_second=True)  # noqa: E731
    if _refused_here(adapter, lambda: build(ON)):
        return
    stock, kept = build(OFF), build(ON)
    point = shared // 16 * 16
    assert (stock.junction, kept.junction) == (0, point)
    second = SECOND_HIT[case]
    assert stock.hits == (0, second, CPU_ONLY_STOCK[case])
    assert kept.hits == (0, second, point)
    assert (stock.external, kept.external) == (CPU_ONLY_STOCK[case], point)
    assert (stock.cpu_pins, kept.cpu_pins, stock.unexpected, kept.unexpected) == (0, 0, 0, 0)
    stored = CPU_ONLY_STORED[case]
    if adapter.native_junction_manager_attr is not None:
        stored = CPU_ONLY_NATIVE_STORED.get(case, stored)
    assert (stock.stored, kept.stored) == stored


@pytest.mark.both_schedulers
@pytest.mark.parametrize("case", sorted(CASES))
def test_cost_one_mamba_block_per_divergence(plugin, adapter, case):
    geometry, shared = CASES[case]
    if _refused_here(adapter, lambda: siblings(adapter, geometry, shared, ON, reset_gpu=False)):
        return
    stock = siblings(adapter, geometry, shared, OFF, reset_gpu=False)
    kept = siblings(adapter, geometry, shared, ON, reset_gpu=False)
    (stock_chunks, chunks), (stock_states, states) = CHUNKS[case], STATES[case]
    if adapter.native_junction_manager_attr is not None:
        chunks, states = NATIVE.get(case, (chunks, states))
    assert (stock.chunks, kept.chunks) == (stock_chunks, chunks)
    assert (stock.mamba_states, kept.mamba_states) == (stock_states, states)
    # Each kept state is stored on the CPU tier once (no double store).
    assert (stock.stored, kept.stored) == (stock_states, states)


def _after_an_answer(adapter, config: dict, answer_tokens: int) -> tuple[tuple[int, int, int], int]:
    """Qwen3-Next geometry. r0: a 1,000-token prompt, whose end sits inside attention block 1
    (544..1088), and ``answer_tokens`` more; r1 and r2 share its first 800 tokens. Returns the
    hits and r1's divergence point."""
    engine = SimEngine(QWEN3_NEXT, adapter=adapter, kv_connector=CONNECTOR_NAME,
                       kv_connector_extra_config={"cpu_bytes_to_use": CPU_BYTES}, additional_config=config)  # fmt: skip
    prefix = _random_tokens(1000, seed=0)
    engine.add_request("r0", prefix, max_tokens=answer_tokens)
    engine.run_until_idle()
    (r1_hit, r2_hit), junction = _siblings_sharing_800(engine, prefix)
    return (engine.outcomes["r0"].hit_tokens, r1_hit, r2_hit), junction


def _siblings_sharing_800(engine, prefix: list[int]) -> tuple[tuple[int, int], int]:
    """r1, then r2: ``prefix``'s first 800 tokens and 100 of their own, each run to the end. Returns
    their hits and r1's divergence point."""
    requests = []
    for k in (1, 2):
        requests.append(engine.add_request(f"r{k}", prefix[:800] + _random_tokens(100, seed=k), max_tokens=2))
        engine.run_until_idle()
    return (engine.outcomes["r1"].hit_tokens, engine.outcomes["r2"].hit_tokens), requests[0].shared_prefix_boundary


def _random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


@pytest.mark.both_schedulers
def test_unit_keys_outlive_the_answer_that_fills_their_block(plugin, adapter):
    """r0's answer (100 tokens) fills the attention block holding its prompt's end; the block's
    promotion to a full key drops its partial keys. The option keys the block's unit boundaries
    again under the full key, so r1 still sees the divergence at 800 and keeps the state there,
    and r2 resumes at 800, as after a 2-token answer (before, r1 saw none: junction 0, r2 hit 544,
    what the wheel alone gets)."""
    if _refused_here(adapter, lambda: _after_an_answer(adapter, ON, 100)):
        return
    assert _after_an_answer(adapter, OFF, 100) == ((0, 544, 544), 0)
    assert _after_an_answer(adapter, ON, 2) == ((0, 544, 800), 800)
    assert _after_an_answer(adapter, ON, 100) == ((0, 544, 800), 800)


def _after_a_preemption(adapter, config: dict, preempted_at: int) -> tuple[int, tuple[int, int], int]:
    """Qwen3-Next geometry, no connector. r0 (a 1,000-token prompt, 200 answer tokens) is preempted
    once it has computed ``preempted_at`` tokens, with the GPU prefix cache dropped
    (``reset_prefix_cache(reset_running_requests=True)``, as an RL weight update does), and recomputes
    into new blocks; then r1 and r2 share its first 800 tokens. Returns r0's first chunk after the
    preemption, the hits of r1 and r2, and r1's divergence point."""
    engine = SimEngine(QWEN3_NEXT, adapter=adapter, additional_config=config)
    prefix = _random_tokens(1000, seed=0)
    r0 = engine.add_request("r0", prefix, max_tokens=200)
    while r0.num_computed_tokens < preempted_at:
        engine.step()
    assert engine.scheduler.reset_prefix_cache(reset_running_requests=True)
    chunks = [step.num_scheduled_tokens["r0"] for step in engine.run_until_idle() if "r0" in step.num_scheduled_tokens]
    assert r0.num_preemptions == 1
    hits, junction = _siblings_sharing_800(engine, prefix)
    return chunks[0], hits, junction


@pytest.mark.both_schedulers
def test_unit_keys_reach_the_blocks_a_preempted_request_recomputes(plugin, adapter):
    """r0 is preempted after its answer filled the block holding its prompt's end (1,090 computed: its
    keying was done) and recomputes 1,088 tokens in one chunk into new blocks. They are keyed at every
    unit again, so r1 (whose lookup finds no Mamba state at or below 800: r0's recompute kept the one
    at 1,088) sees the divergence at 800 and keeps the state there, and r2 resumes at 800. Before, the
    recomputed blocks carried block-end keys only: r1's junction was 544, r2 resumed at 544. Preempted
    earlier (1,050: its keying waited for the block to fill), the recompute was keyed already."""
    if _refused_here(adapter, lambda: _after_a_preemption(adapter, ON, 1090)):
        return
    assert _after_a_preemption(adapter, OFF, 1090) == (1088, (0, 544), 544)
    assert _after_a_preemption(adapter, ON, 1090) == (1088, (0, 800), 800)
    assert _after_a_preemption(adapter, ON, 1050) == (544, (544, 800), 800)


def _block_zero_unit_keys(adapter, config: dict) -> tuple[list[int], list[int]]:
    """Attention block = Mamba block = 64. r0 (100 tokens) keys X[:16..96]; r1 (X[:50] and 150 of its
    own) finds attention KV to 48 and no Mamba state below it. Returns r1's chunks and the unit
    boundaries (16, 32, 48) its block 0 carries a key for once it finished."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    geometry = HybridGeometry(attention_block_size=64, mamba_block_size=64, hash_block_size=16)
    engine = SimEngine(geometry, adapter=adapter, additional_config=config)
    prefix = _random_tokens(100, seed=0)
    engine.run([("r0", prefix)])
    r1 = engine.add_request("r1", prefix[:50] + _random_tokens(150, seed=1))
    chunks = [step.num_scheduled_tokens["r1"] for step in engine.run_until_idle() if "r1" in step.num_scheduled_tokens]
    pool = engine.gpu_block_pool
    block = pool.get_cached_block(r1.block_hashes[3], [0])[0]  # r1's block 0, under its full key

    def keyed_at(position: int) -> bool:
        key = make_block_hash_with_group_id(r1.block_hashes[position // 16 - 1], 0)
        return pool.cached_block_hash_to_block.contain(key, block.block_id)

    return chunks, [position for position in (16, 32, 48) if keyed_at(position)]


def test_unit_keys_outlive_the_chunk_that_fills_their_block(plugin, adapter):
    """r1's prefill stops at its divergence point (48, in block 0's last unit) and keeps the state;
    the next chunk fills block 0, whose promotion to a full key drops the keys at 16, 32 and 48. The
    option writes them again (before, the next call began at the block after 48: r1's block 0 kept none)."""
    if _refused_here(adapter, lambda: _block_zero_unit_keys(adapter, ON)):
        return
    assert _block_zero_unit_keys(adapter, OFF) == ([192, 8], [])
    assert _block_zero_unit_keys(adapter, ON) == ([48, 16, 128, 8], [16, 32, 48])


# Request 2's whole-prompt Mamba count, as vLLM's admission check asks it (apply_admission_cap),
# without the option and with it. Request 2 keeps a state at its divergence point, inside a Mamba
# block; the next chunk copies it into a new block before the kept one is released, so at that
# allocation the request needs one block more than the wheel's count. Admitted on the wheel's count
# into the last free blocks, two such requests under AsyncScheduler (whose preemptions free a step
# late) restarted each other for ever (tests/test_reliability_regressions.py). The backport (0.29)
# counts that block under AsyncScheduler; under Scheduler (a preemption frees at once) and on 0.30+
# the wheel's own count stands.
ADMISSION_COUNTS = {"fa32-mamba544": (1, 2), "fa32-mamba64": (1, 2), "qwen3-next-1000": (1, 2), "qwen3-next-1216": (2, 3)}


@pytest.mark.both_schedulers
@pytest.mark.parametrize("case", sorted(CASES))
def test_admission_counts_the_block_the_divergence_state_keeps(plugin, adapter, case, scheduling):
    geometry, shared = CASES[case]
    if _refused_here(adapter, lambda: admission_count(adapter, geometry, shared, ON)):
        return
    off, on = ADMISSION_COUNTS[case]
    if adapter.native_junction_manager_attr is not None or scheduling == "sync":
        on = off
    assert (admission_count(adapter, geometry, shared, OFF), admission_count(adapter, geometry, shared, ON)) == (off, on)


def admission_count(adapter, geometry: HybridGeometry, shared: int, config: dict) -> int:
    """Request 2's Mamba count in the admission check (observed on the real manager; request 2 runs to the end)."""
    engine = SimEngine(geometry, adapter=adapter, kv_connector=CONNECTOR_NAME,
                       kv_connector_extra_config={"cpu_bytes_to_use": CPU_BYTES}, additional_config=config)
    prefix = tokens(shared)
    engine.add_request("r0", prefix + tokens(SUFFIX, 2000), max_tokens=2)
    engine.run_until_idle()
    counts = record_admission_counts(engine)
    engine.add_request("r1", prefix + tokens(SUFFIX, 2150), max_tokens=2)
    engine.run_until_idle()
    assert len(counts["r1"]) == 1, counts  # admitted at once: one whole-prompt check
    return counts["r1"][0]


def test_option_selects_backport_or_native_gate(plugin, make_engine, adapter):
    """No EAGLE anywhere: 0.29 opens the junction backport's plan, 0.30+ the wheel's own gate."""
    geometry, _ = CASES["qwen3-next-1216"]
    if _refused_here(adapter, lambda: make_engine(geometry, additional_config=ON)):
        return
    off = make_engine(geometry, additional_config=OFF)
    on = make_engine(geometry, additional_config=ON)
    assert not off.vllm_config.speculative_config and not on.scheduler.kv_cache_manager.coordinator.eagle_group_ids
    assert (junction_active(adapter, off.scheduler), junction_active(adapter, on.scheduler)) == (False, True)
    installed = sorted(spec.name for spec in plugin.patch_set.specs if spec.name.startswith("divergence_"))
    assert installed == ["divergence_attention_keys", "divergence_bind", "divergence_keys_after_preemption"]
    managers = on.scheduler.kv_cache_manager.coordinator.single_type_managers
    # The attention manager is keyed at every unit; only where the option is on.
    assert [getattr(m, MANAGER_ATTR, False) for m in managers] == [True, False]
    assert [getattr(m, MANAGER_ATTR, False) for m in off.scheduler.kv_cache_manager.coordinator.single_type_managers] == [False, False]
    if adapter.native_junction_manager_attr is None:
        assert sorted(type(m).__name__ for m in managers) == ["FullAttentionManager", "JunctionMambaManager"]
    else:
        flags = [getattr(m, adapter.native_junction_manager_attr) for m in managers]
        assert flags == [False, True]  # the attention manager keeps the wheel's default


def test_gate_stays_closed_without_partial_hash_hits(plugin, make_engine, adapter, plugin_log):
    """A unit as coarse as the Mamba block: no sub-block state is reachable, so no stop is added."""
    coarse = HybridGeometry(attention_block_size=64, mamba_block_size=64, hash_block_size=64)
    if _refused_here(adapter, lambda: make_engine(coarse, additional_config=ON)):
        return
    engine = make_engine(coarse, additional_config=ON)
    assert junction_active(adapter, engine.scheduler) is False
    assert any("mamba_divergence_checkpoint is on but inactive here" in m for m in plugin_log.messages())


def test_refusal_names_the_first_wheel_with_the_option():
    first = first_wheel_where("divergence_checkpoint_supported")
    assert first == next(cls.tested_wheels[0] for cls in ADAPTERS if cls.divergence_checkpoint_supported)
    check_divergence_supported(False, False, "0.26.0", first)  # off: nothing to refuse
    with pytest.raises(PluginConfigError) as refused:
        check_divergence_supported(True, False, "0.26.0", first)
    assert str(refused.value) == (
        "invalid hybrid-kv-plugin configuration: hybrid_kv.mamba_divergence_checkpoint: true "
        f"needs vLLM >= {first} and this is vLLM 0.26.0 (allowed here: false)"
    )


def test_old_wheels_refuse_the_option(plugin, make_engine, adapter):
    if _supported(adapter):
        engine = make_engine(CASES["fa32-mamba544"][0], additional_config=ON)
        assert engine.scheduler.hybrid_kv_config.mamba_divergence_checkpoint is True
        return
    with pytest.raises(PluginConfigError) as refused:
        make_engine(CASES["fa32-mamba544"][0], additional_config=ON)
    assert str(refused.value) == (
        "invalid hybrid-kv-plugin configuration: hybrid_kv.mamba_divergence_checkpoint: true needs vLLM >= "
        f"{first_wheel_where('divergence_checkpoint_supported')} and this is vLLM {adapter.version} (allowed here: false)"
    )


def test_other_values_stop_start_up(plugin, make_engine):
    for bad in ("true", 1, None):
        with pytest.raises(PluginConfigError) as refused:
            make_engine(CASES["fa32-mamba544"][0], additional_config={"hybrid_kv": {"mamba_divergence_checkpoint": bad}})
        assert str(refused.value) == (
            "invalid hybrid-kv-plugin configuration: hybrid_kv.mamba_divergence_checkpoint: Input should be "
            f"a valid boolean (got {bad!r}; allowed: true or false)"
        )
