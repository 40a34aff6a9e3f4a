"""Mamba shared-prefix (junction) checkpoint under EAGLE (seed 003, vLLM PR #53945).

Real Scheduler + KVCacheManager of the installed wheel, EAGLE through a real
``SpeculativeConfig``. Geometry of the scenarios: full attention block 16, Mamba
block 16 ("align"), prefix-match unit 4. On 0.26-0.29 the plugin backports the
feature; on 0.30+ the switch maps onto the wheel's native flag.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

import hybrid_kv_plugin
from hybrid_kv_plugin import registration
from hybrid_kv_plugin.adapters import Feature, Support
from hybrid_kv_plugin.sim import HybridGeometry, SimEngine
from hybrid_kv_plugin.sim.wheel import eagle_block_drop_options, junction_active

from helpers import record_admission_counts, tokens

SWITCH_ON = {"hybrid_kv": {"mamba_shared_prefix_checkpoint": True}}
SWITCH_OFF = {"hybrid_kv": {"mamba_shared_prefix_checkpoint": False}}
BACKPORT_WHEELS = ("0.26.0", "0.27.1", "0.28.0", "0.29.0")

# Shared prefixes and per-request suffixes: disjoint windows of the token sequence.
PREFIX = tokens(64)
OTHER_PREFIX = tokens(64, 500)


def suffix(k: int, n: int = 16) -> list[int]:
    return tokens(n, 200 + 50 * k)


def geometry(*, eagle: bool = True, mamba_block: int = 16, hash_unit: int = 4, **kwargs) -> HybridGeometry:
    return HybridGeometry(
        attention_block_size=16, mamba_block_size=mamba_block, hash_block_size=hash_unit, eagle=eagle, **kwargs
    )


@dataclass
class Siblings:
    hits: dict[str, int]
    junction: int  # follower 1's shared_prefix_boundary, set at its admission
    follower_chunks: list[int]  # follower 1's prefill chunks, in tokens


def run_siblings(engine: SimEngine, shared: int = 24, prefix: list[int] = PREFIX) -> Siblings:
    """Owner = prefix[:shared] + its own tokens, then two followers sharing only prefix[:shared]."""
    hits = engine.run([("owner", prefix[:shared] + suffix(0))])
    first = len(engine.steps)
    follower = engine.add_request("f1", prefix[:shared] + suffix(1))
    engine.run_until_idle()
    chunks = [step.num_scheduled_tokens["f1"] for step in engine.steps[first:] if "f1" in step.num_scheduled_tokens]
    hits["f1"] = engine.outcomes["f1"].hit_tokens
    hits.update(engine.run([("f2", prefix[:shared] + suffix(2))]))
    return Siblings(hits, follower.shared_prefix_boundary, chunks)


def run_producer_and_sibling(engine: SimEngine, shared: int = 40, prefix: list[int] = PREFIX) -> dict[str, int]:
    """A producer whose whole prompt is the shared prefix, then a sibling that extends it."""
    hits = engine.run([("producer", prefix[:shared])])
    hits.update(engine.run([("sibling", prefix[:shared] + suffix(3))]))
    return hits


def cached_entries(engine: SimEngine) -> list[tuple[int, object]]:
    return [(block.block_id, block.block_hash) for block in engine.gpu_block_pool.blocks if block.block_hash is not None]


def workload_trace(engine: SimEngine, shared: int) -> tuple:
    """Everything a switch may change: hits, every step's scheduled tokens, the cache map."""
    siblings = run_siblings(engine, shared)
    pair = run_producer_and_sibling(engine, shared, OTHER_PREFIX)
    steps = [tuple(sorted(step.num_scheduled_tokens.items())) for step in engine.steps]
    return siblings.hits, pair, steps, cached_entries(engine)


# ---------------------------------------------------------------------------------------------
# Which code provides the feature


def test_switch_selects_backport_or_native(plugin, make_engine, adapter):
    engine = make_engine(geometry(), additional_config=SWITCH_ON)
    coordinator = engine.scheduler.kv_cache_manager.coordinator
    managers = sorted(type(m).__name__ for m in coordinator.single_type_managers)
    installed = sorted(spec.name for spec in plugin.patch_set.specs if spec.name.startswith("junction_"))
    if adapter.version in BACKPORT_WHEELS:
        assert adapter.verdict(Feature.MAMBA_SHARED_PREFIX_CHECKPOINT).support is Support.BACKPORT
        assert installed == ["junction_coordinator", "junction_reservation", "junction_split"]
        assert (type(coordinator).__name__, managers) == (
            "JunctionHybridKVCacheCoordinator",
            ["FullAttentionManager", "JunctionMambaManager"],
        )
    else:
        # The switch is set on CacheConfig before the stock Scheduler constructor runs, so
        # the native KVCacheManager computes its own gate from it; nothing is patched.
        assert adapter.verdict(Feature.MAMBA_SHARED_PREFIX_CHECKPOINT).support is Support.NATIVE
        assert installed == []
        assert (type(coordinator).__name__, managers) == ("HybridKVCacheCoordinator", ["FullAttentionManager", "MambaManager"])
        assert getattr(engine.vllm_config.cache_config, adapter.native_junction_flag) is True
        assert getattr(engine.scheduler.kv_cache_manager, adapter.native_junction_scheduler_attr) is True
    assert junction_active(adapter, engine.scheduler) is True


# ---------------------------------------------------------------------------------------------
# The two mechanisms, with exact numbers

# follower 2's hit (switch off, switch on) and follower 1's junction, per wheel.
EXACT_JUNCTION = {v: ((0, 12), 12) for v in ("0.26.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0")}
EXACT_JUNCTION["0.33.0"] = ((16, 16), 16)


@pytest.fixture(autouse=True)
def _reproducible_block_hashes(monkeypatch):
    # Compared engines must derive the same NONE_HASH (random per engine on some wheels).
    monkeypatch.setenv("PYTHONHASHSEED", "0")


def switch(on: bool, source: str, monkeypatch) -> dict | None:
    """The plugin switch from ``--additional-config`` or from its environment override."""
    if source == "environment":
        monkeypatch.setenv("HYBRID_KV_MAMBA_SHARED_PREFIX_CHECKPOINT", "1" if on else "0")
        return None
    return SWITCH_ON if on else SWITCH_OFF


@pytest.mark.parametrize("source", ["additional_config", "environment"])
def test_exact_junction_stop_serves_the_next_follower(plugin, make_engine, adapter, monkeypatch, source):
    """Scenario A of the reference: owner = P[:24] + 16 own tokens, then followers 1 and 2 sharing P[:24].

    Follower 1 hits nothing (its full-attention hit, 16, loses one hash unit to the EAGLE
    drop: 12; no Mamba state lies at or below 12) and learns junction 12. The stock split
    only stops at the junction floored to the block grid (0, no stop); with the switch it
    ends its first chunk at exactly 12 and the Mamba manager keeps that state, so
    follower 2 hits 12 instead of 0 - the hand-derived candidate, measured identical on
    0.26-0.32 (backport below 0.30, native above).

    0.33 differs by a named upstream change: it hashes the drafter's lookahead token into
    every block hash and drops no unit under EAGLE ("lookahead block hashes"), so the
    junction is the block boundary 16 where the stock floored stop already caches a state:
    16 either way. With ``disable_lookahead_block_hashes`` (the drop as before) 0.33
    measures 0 -> 12 like 0.32 (second half of this test).
    """
    (off_hit, on_hit), junction = EXACT_JUNCTION[adapter.version]
    shapes = [geometry()]
    if drop := eagle_block_drop_options(adapter):
        shapes.append(geometry(extra_speculative_config=drop))
    measured = []
    for shape in shapes:
        off = run_siblings(make_engine(shape, additional_config=switch(False, source, monkeypatch)))
        on = run_siblings(make_engine(shape, additional_config=switch(True, source, monkeypatch)))
        assert (off.hits["f1"], on.hits["f1"]) == (0, 0)
        measured.append((off.hits["f2"], on.hits["f2"], off.junction, on.junction, on.follower_chunks[0]))
    assert measured[0] == (off_hit, on_hit, junction, junction, junction)
    # 0.33 with the EAGLE drop as before: like 0.26-0.32.
    assert measured[1:] == [(0, 12, 12, 12, 12)] * (len(shapes) - 1)


# sibling's hit (switch off, switch on) per wheel.
EAGLE_TAIL = {v: (16, 36) for v in BACKPORT_WHEELS} | {v: (36, 36) for v in ("0.30.0", "0.31.0", "0.32.0", "0.33.0")}


def test_eagle_prompt_tail_checkpoint_one_unit_lower(plugin, make_engine, adapter):
    """Scenario B of the reference: producer prompt P[:40], then a sibling P[:40] + 16 tokens.

    The sibling's full-attention hit is 40, minus the EAGLE drop: 36. The stock prompt-tail
    checkpoint sits at the prompt's last hash boundary (40), where no EAGLE hit can land,
    so the sibling falls back to the block state at 16. With the switch the producer's
    split also stops at 36 and the Mamba manager keeps that state: 16 -> 36, the
    hand-derived candidate, on 0.26-0.29.

    On 0.30+ the switch adds nothing here: vLLM PR #53945 made this one-unit shift
    unconditional (only the exact junction stop is behind the flag), so 36 either way.
    """
    off = run_producer_and_sibling(make_engine(geometry(), additional_config=SWITCH_OFF))
    on = run_producer_and_sibling(make_engine(geometry(), additional_config=SWITCH_ON))
    assert (off["sibling"], on["sibling"]) == EAGLE_TAIL[adapter.version]
    assert off["producer"] == on["producer"] == 0
    for drop in filter(None, [eagle_block_drop_options(adapter)]):
        legacy = geometry(extra_speculative_config=drop)
        off = run_producer_and_sibling(make_engine(legacy, additional_config=SWITCH_OFF))
        on = run_producer_and_sibling(make_engine(legacy, additional_config=SWITCH_ON))
        assert (off["sibling"], on["sibling"]) == (36, 36)


# The Mamba admission counts (producer, sibling) of scenario B, switch off and on. With the switch the
# producer keeps the state at the lowered tail (36) and the sibling, resuming there, at its own (52);
# the chunk after each copies it into a new block before the kept one is released. The backport
# (0.26-0.29) counts that block in the admission check under AsyncScheduler (a preemption frees a
# step late there: tests/test_reliability_regressions.py, the divergence case); under Scheduler, and
# on 0.30+, the wheel's own count stands (the sibling's 3 -> 4 off/on there is its deeper hit).
EAGLE_TAIL_ADMISSION = {"sync": ((2, 3), (2, 4)), "async": ((2, 3), (3, 5))}
NATIVE_EAGLE_TAIL_ADMISSION = ((2, 4), (2, 4))


@pytest.mark.both_schedulers
def test_admission_counts_the_block_the_lowered_tail_keeps(plugin, make_engine, adapter, scheduling):
    def admission_counts(config) -> tuple[int, int]:
        engine = make_engine(geometry(), additional_config=config)
        counts = record_admission_counts(engine)
        run_producer_and_sibling(engine)
        return counts["producer"][-1], counts["sibling"][-1]

    expected = EAGLE_TAIL_ADMISSION[scheduling] if adapter.version in BACKPORT_WHEELS else NATIVE_EAGLE_TAIL_ADMISSION
    assert (admission_counts(SWITCH_OFF), admission_counts(SWITCH_ON)) == expected


# The async-load reservation while the sibling of scenario B, with a 48-token suffix, prefills 16
# tokens a step: (its computed tokens, the wheel's sum of _request_remaining_blocks, the reservation
# vLLM admits an async load against) after each step it is still prefilling. Its lowered tail (84)
# keeps a state the next chunk copies into a new block: one block more until the prefill passes it.
# The backport adds that block to each request's count under AsyncScheduler, to the reservation
# under Scheduler (patches/junction_reservation.py): the same reservation under both. 0.30+ count
# natively (0.31 in each request's count; 0.30, 0.32 and 0.33 not at 80, below the tail).
RESERVATION = {
    "sync": [(48, 3, 4), (64, 2, 3), (80, 1, 2), (84, 2, 2)],
    "async": [(48, 4, 4), (64, 3, 3), (80, 2, 2), (84, 2, 2)],
}
NATIVE_RESERVATION = {
    "0.30.0": [(48, 3, 3), (64, 2, 2), (80, 1, 1), (84, 2, 2)],
    "0.31.0": [(48, 4, 4), (64, 3, 3), (80, 2, 2), (84, 2, 2)],
    "0.32.0": [(48, 3, 3), (64, 2, 2), (80, 1, 1), (84, 1, 1)],
    "0.33.0": [(48, 3, 3), (64, 2, 2), (80, 1, 1), (84, 1, 1)],
}


@pytest.mark.both_schedulers
def test_async_load_reservation_counts_the_block_the_lowered_tail_keeps(plugin, make_engine, adapter, scheduling):
    engine = make_engine(geometry(max_num_batched_tokens=16, max_num_seqs=4), additional_config=SWITCH_ON)
    scheduler = engine.scheduler
    engine.run([("producer", PREFIX[:40])])
    sibling = engine.add_request("sibling", PREFIX[:40] + suffix(3, 48))
    seen = []
    while engine.has_work():
        engine.step()
        if sibling in scheduler._inflight_prefills:
            stock = sum(map(scheduler._request_remaining_blocks, scheduler._inflight_prefills))
            seen.append((sibling.num_computed_tokens, stock, scheduler._inflight_prefill_reserved_blocks()))
    assert engine.outcomes["sibling"].hit_tokens == 36
    expected = RESERVATION[scheduling] if adapter.version in BACKPORT_WHEELS else NATIVE_RESERVATION[adapter.version]
    assert seen == expected


# exact replay's hit (switch off, switch on) under retention 0, per wheel.
REPLAY_UNDER_SPARSE_RETENTION = {v: (0, 16) for v in BACKPORT_WHEELS} | {
    "0.30.0": (16, 16),
    "0.31.0": (16, 16),
    "0.32.0": (36, 36),
    "0.33.0": (36, 36),
}


def test_sparse_retention_keeps_the_eagle_replay_state(plugin, make_engine, adapter, monkeypatch):
    """The coordinator hands EAGLE-aware replay boundaries to the Mamba managers.

    Producer P[:40], then an exact replay of it, with prefix-cache retention 0 (keep only
    the Mamba states at "reachable" positions). The replay's full-attention hit is 36
    (at most N - 1 = 39, on the hash grid), 32 after the EAGLE drop, so it needs the state
    at 16. Stock 0.26-0.29 name only the last prompt token (39, i.e. the block ending at
    32, never materialised: under EAGLE the split pins 16, then runs 16 -> 40) and the
    junction, so the state at 16 is dropped: hit 0. With the switch the coordinator adds
    the EAGLE replay boundaries (one block below the grid positions of N - 1 and N: 16):
    hit 16. On 0.30+ vLLM PR #53945 hands these boundaries over unconditionally: 16 either
    way. From 0.32 the replay hits the producer's prompt-tail state at 36 either way: 0.32
    reworked that checkpoint (``get_mamba_prefill_checkpoint_position``, the "<= N - 1"
    change) so that an exact replay of the same prompt resumes at it; 0.33 also hashes the
    drafter's lookahead token instead of dropping a unit. (The backport adds the boundaries to the wheel's
    own instead of replacing them, so it never retains less than the switch-off run.)
    """
    if adapter.retention_interval_env_var:
        monkeypatch.setenv(adapter.retention_interval_env_var, "0")
    hits = []
    for config in (SWITCH_OFF, SWITCH_ON):
        engine = make_engine(geometry(prefix_cache_retention_interval=0), additional_config=config)
        assert engine.scheduler.kv_cache_manager.coordinator.retention_interval == 0
        engine.run([("producer", PREFIX[:40])])
        hits.append(engine.run([("replay", PREFIX[:40])])["replay"])
    assert tuple(hits) == REPLAY_UNDER_SPARSE_RETENTION[adapter.version]


def test_no_leaked_or_double_freed_mamba_blocks(plugin, make_engine):
    engine = make_engine(geometry(), additional_config=SWITCH_ON)
    pool = engine.gpu_block_pool
    free_at_start = pool.get_num_free_blocks()
    run_siblings(engine)
    run_producer_and_sibling(engine, prefix=OTHER_PREFIX)
    assert free_at_start == engine.geometry.num_gpu_blocks - 1  # all but the null block
    assert pool.get_num_free_blocks() == free_at_start
    assert sorted({block.ref_cnt for block in pool.blocks if not block.is_null}) == [0]
    for manager in engine.scheduler.kv_cache_manager.coordinator.single_type_managers:
        assert dict(manager.req_to_blocks) == {} and manager._partial_hit_reqs == {}


# ---------------------------------------------------------------------------------------------
# Off means stock; on never hurts; a closed gate changes nothing

# EAGLE in every case: the switch without EAGLE is refused at start-up (test_bad_input.py).
SWEEP = [
    (mamba_block, hash_unit, shared)
    for mamba_block, hash_unit in ((16, 4), (16, 8), (16, 16), (32, 8), (32, 16), (64, 16))
    for shared in (20, 28, 44)
]


@pytest.mark.parametrize(("mamba_block", "hash_unit", "shared"), SWEEP)
def test_switch_never_lowers_a_hit(plugin, make_engine, adapter, mamba_block, hash_unit, shared):
    shape = geometry(mamba_block=mamba_block, hash_unit=hash_unit)
    off_engine = make_engine(shape, additional_config=SWITCH_OFF)
    on_engine = make_engine(shape, additional_config=SWITCH_ON)
    off, on = workload_trace(off_engine, shared), workload_trace(on_engine, shared)
    gate_open = junction_active(adapter, on_engine.scheduler)
    assert gate_open is (hash_unit < mamba_block)
    assert junction_active(adapter, off_engine.scheduler) is False
    for name, hit in {**off[0], **off[1]}.items():
        assert {**on[0], **on[1]}[name] >= hit, name
    if not gate_open:
        assert on == off


@pytest.mark.parametrize(("mamba_block", "hash_unit", "shared"), [(16, 4, 20), (16, 4, 44), (32, 8, 28), (16, 16, 28)])
def test_switch_off_is_byte_identical_to_stock(no_plugin, make_engine, mamba_block, hash_unit, shared):
    shape = geometry(mamba_block=mamba_block, hash_unit=hash_unit)
    stock = workload_trace(make_engine(shape), shared)
    hybrid_kv_plugin.register()
    assert registration.STATE.status == "active"
    assert workload_trace(make_engine(shape), shared) == stock
    assert workload_trace(make_engine(shape, additional_config=SWITCH_OFF), shared) == stock


def _use_multi_module_mtp(monkeypatch):
    """A drafter with two MTP modules (an edge: no draft model runs here).

    A real multi-module MTP config needs an MTP checkpoint config; what the scheduler
    takes from it is only this bit, which sets its prefill lookahead to
    ``num_speculative_tokens`` and so the coordinator's re-prefillable tail.
    """
    from vllm.config import SpeculativeConfig

    # raising=False: 0.26 has no such bit (nor a re-prefill tail) at all.
    monkeypatch.setattr(SpeculativeConfig, "use_multi_module_mtp", lambda self: True, raising=False)


GATE_CASES = {
    "no_partial_hash_hits": (
        geometry(hash_unit=16),
        "partial hash hits are disabled (prefix-match unit not finer than the Mamba block)",
    ),
    "multi_module_mtp": (geometry(num_speculative_tokens=2), "multi-module MTP re-prefills a tail"),
}
# Wheels whose coordinator leaves a re-prefillable MTP tail uncached (0.28 introduced it).
REPREFILL_TAIL = {"0.26.0": 0, "0.27.1": 0}


@pytest.mark.parametrize("case", list(GATE_CASES))
def test_closed_gate_adds_no_stop_and_no_state(plugin, make_engine, adapter, monkeypatch, plugin_log, case):
    shape, reason = GATE_CASES[case]
    if case == "multi_module_mtp":
        _use_multi_module_mtp(monkeypatch)
    on_engine = make_engine(shape, additional_config=SWITCH_ON)
    off_engine = make_engine(shape, additional_config=SWITCH_OFF)
    coordinator = on_engine.scheduler.kv_cache_manager.coordinator
    if case == "multi_module_mtp":
        assert adapter.coordinator_reprefillable_tokens(coordinator) == REPREFILL_TAIL.get(adapter.version, 1)
    if case == "multi_module_mtp" and not REPREFILL_TAIL.get(adapter.version, 1):
        # 0.26-0.27 cache the chunk end whatever the drafter: the junction state stays valid.
        assert junction_active(adapter, on_engine.scheduler) is True
        return
    assert junction_active(adapter, on_engine.scheduler) is False
    assert workload_trace(on_engine, 24) == workload_trace(off_engine, 24)
    if adapter.version in BACKPORT_WHEELS:
        said = [line for line in plugin_log.messages(logging.INFO) if "inactive" in line]
        assert said == [f"hybrid-kv-plugin: mamba_shared_prefix_checkpoint is on but inactive here: {reason}"]


def test_junction_outside_the_prompt_chunk_adds_nothing(plugin, make_engine, adapter):
    """Beyond the prompt, or already computed, a junction gets no stop and no state.

    A junction past the prompt only arises when a preempted request that decoded past a
    block boundary is readmitted; the test runs a real request (40 prompt tokens) until
    the Mamba block holding the junction is its live block (44 prompt tokens: its stock prompt-tail
    state is at 44 and its EAGLE tail one unit lower at 40, so the junction is tried at 36), sets ``shared_prefix_boundary``
    the way that readmission would, and asks the real split and the real Mamba manager
    directly: with a live block there, a missing guard would register a state.
    """
    results = []
    for config in (SWITCH_OFF, SWITCH_ON):
        engine = make_engine(geometry(), additional_config=config)
        assert junction_active(adapter, engine.scheduler) is (config is SWITCH_ON)
        engine.add_request("resumed", PREFIX[:24] + suffix(1, 20), max_tokens=32)
        request = engine.scheduler.requests["resumed"]
        mamba = engine.scheduler.kv_cache_manager.coordinator.single_type_managers[1]
        retention = (None,) if adapter.native_junction_flag else ()  # 0.30+ also pass the retention

        def state_at(boundary: int) -> object:
            live = mamba.req_to_blocks["resumed"][boundary // 16]
            assert not live.is_null  # the block that would hold the state is the request's own
            request.shared_prefix_boundary = boundary
            return mamba._cache_partial_tail_block(request, boundary, *retention)

        while request.num_computed_tokens < 45:  # decoding inside Mamba block 2 (tokens 32..48)
            engine.step()
        computed_at_36 = (request.num_computed_tokens, state_at(36))  # in the prompt, already computed
        # The EAGLE-lowered prompt tail (40), already computed: the backport keeps nothing there;
        # 0.30+'s own manager registers it (its callers only ever pass the frontier).
        lowered_tail_kept = mamba._cache_partial_tail_block(request, 40, *retention) is not None
        while request.num_computed_tokens < 49:  # decoding inside Mamba block 3 (tokens 48..64)
            engine.step()
        request.shared_prefix_boundary = 52  # inside the next chunk, past the prompt
        past_prompt = engine.scheduler._mamba_block_aligned_split(request, 12)
        results.append((computed_at_36, lowered_tail_kept, request.num_computed_tokens, past_prompt, state_at(52)))
    native = adapter.native_junction_flag is not None
    assert results == [((45, None), native, 49, 12, None), ((45, None), native, 49, 12, None)]


# ---------------------------------------------------------------------------------------------
# Native flag, registry re-registration, changed wheels


def test_native_flag_set_by_the_user_is_the_same_feature(plugin, make_engine, adapter, plugin_log):
    flag = adapter.native_junction_flag
    if flag is None:  # 0.26-0.29: vLLM refuses either later name; the plugin's switch is the only way
        from vllm.config import CacheConfig

        for name in ("enable_mamba_fine_grained_prefix_cache", "enable_mamba_shared_prefix_checkpoint"):
            with pytest.raises(ValueError, match=f"{name}\n  Unexpected keyword argument"):
                CacheConfig(**{name: True})
        return
    native = geometry(extra_cache_config={flag: True})
    by_flag = run_siblings(make_engine(native))
    make_engine(native)
    by_switch = run_siblings(make_engine(geometry(), additional_config=SWITCH_ON))
    assert by_flag == by_switch
    lines = [line for line in plugin_log.messages(logging.INFO) if flag in line]
    assert lines == [
        f"hybrid-kv-plugin: native CacheConfig.{flag} is set; on vLLM {adapter.version} it is the same "
        "feature as the plugin's mamba_shared_prefix_checkpoint switch"
    ]


def test_junction_classes_survive_spec_reregistration(plugin, make_engine, adapter):
    """vLLM re-registers MambaSpec -> MambaManager at every engine start and asserts on a
    different manager; the plugin keeps the registry stock and upgrades its own managers."""
    from vllm.v1.core import single_type_kv_cache_manager as managers
    from vllm.v1.kv_cache_interface import MambaSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    engine = make_engine(geometry(), additional_config=SWITCH_ON)
    spec = engine.kv_cache_config.kv_cache_groups[1].kv_cache_spec
    assert isinstance(spec, MambaSpec)
    for _ in range(2):  # what _initialize_kv_caches does, once per engine start
        managers.register_all_kvcache_specs(engine.vllm_config)
    again = make_engine(geometry(), additional_config=SWITCH_ON)
    assert KVCacheSpecRegistry.get_manager_class(spec) is managers.MambaManager
    mamba = again.scheduler.kv_cache_manager.coordinator.single_type_managers[1]
    expected = "JunctionMambaManager" if adapter.version in BACKPORT_WHEELS else "MambaManager"
    assert type(mamba).__name__ == expected and isinstance(mamba, managers.MambaManager)
    assert run_siblings(again).hits["f2"] == EXACT_JUNCTION[adapter.version][0][1]

    hybrid_kv_plugin.uninstall()
    managers.register_all_kvcache_specs(engine.vllm_config)
    stock = make_engine(geometry(), additional_config=SWITCH_ON)
    assert type(stock.scheduler.kv_cache_manager.coordinator).__name__ == "HybridKVCacheCoordinator"
    assert type(stock.scheduler.kv_cache_manager.coordinator.single_type_managers[1]) is managers.MambaManager


def test_changed_split_leaves_vllm_unpatched(no_plugin, monkeypatch, adapter, plugin_log):
    from vllm.v1.core.sched.scheduler import Scheduler

    stock_split = Scheduler._mamba_block_aligned_split

    def newer_split(self, request, num_new_tokens, num_new_local_computed_tokens=0, num_external_computed_tokens=0):
        if self.mamba_prefill_checkpoint_alignment:  # an input this plugin release does not know
            return num_new_tokens
        return stock_split(self, request, num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens)

    monkeypatch.setattr(Scheduler, "_mamba_block_aligned_split", newer_split)
    hybrid_kv_plugin.register()
    if adapter.version not in BACKPORT_WHEELS:
        assert registration.STATE.status == "active"  # native: the split is not a patch target
        return
    assert registration.STATE.status == "mismatch"
    assert Scheduler._mamba_block_aligned_split is newer_split
    (line,) = plugin_log.messages(logging.WARNING)
    assert "Scheduler._mamba_block_aligned_split changed (reads different scheduler attributes (new:" in line
    assert "mamba_prefill_checkpoint_alignment" in line and "nothing patched" in line
