"""Positive controls: every invariant checker fires on a known violation, with the expected message.

A checker that never fires proves nothing. Each test runs the real scheduler and
connector of the installed wheel (the CPU-tier hit of ``test_cpu_offload_behaviour``
or the randomized suite's harness) and plants one violation where the checker
looks: in the connector metadata the worker acts on, in the block pools, or in
the connector's counters. The clean run of the same scenario is checked first, so
the control also shows that the plant, not the scenario, is what fires.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from hybrid_kv_plugin.adapters import Feature
from hybrid_kv_plugin.connector_names import CONNECTOR_NAME
from hybrid_kv_plugin.sim import HybridGeometry, SimEngine
from hybrid_kv_plugin.sim.invariants import OffloadInvariants

from helpers import tokens
from scenarios.offload import CPU_BYTES, OffloadRun, cpu_tier_hit
from soak.harness import FaultHarness, variants
from soak.step_invariants import FailedLoad, audit_pool

# test_cpu_offload_behaviour's CPU-tier hit: 336 tokens hit, 64 of them local; the CPU tier
# loads attention blocks 4..20 and the Mamba state of 336 tokens into Mamba block 5.
PROMPT = {"0.32.0": 352, "0.33.0": 352}
LOADS = [*((0, i, (i + 1) * 16) for i in range(4, 21)), (1, 5, 336)]


@pytest.fixture
def feature(adapter):
    if not adapter.supports(Feature.FINE_GRAINED_CPU_HITS):
        pytest.fail(f"vLLM {adapter.version} lost fine-grained CPU hits")  # every supported wheel has them


def _run(adapter, tamper=None) -> OffloadRun:
    """The CPU-tier-hit engine; ``tamper(connector)`` wraps the connector before the checker does.

    A tampered run turns the byte check off: it would stop the run at the first wrong load,
    before the checker under test sees the violation (test_byte_cache.py controls that check).
    """
    engine = SimEngine(
        HybridGeometry(), adapter=adapter, kv_connector=CONNECTOR_NAME,
        kv_connector_extra_config={"cpu_bytes_to_use": CPU_BYTES}, byte_check=tamper is None,
    )
    if tamper is not None:
        tamper(engine)
    return OffloadRun(engine, OffloadInvariants(engine), itertools.count())


def _hit(adapter, run: OffloadRun) -> int:
    return cpu_tier_hit(run, tokens(PROMPT.get(adapter.version, 336)), warm=[tokens(64)])


def _wrap_meta(engine, change) -> None:
    """``change(meta, manager)`` edits each connector metadata after vLLM built it, before the worker sees it."""
    original = engine.connector.build_connector_meta

    def build_connector_meta(scheduler_output):
        meta = original(scheduler_output)
        change(meta, engine.offload_manager)
        return meta

    engine.connector.build_connector_meta = build_connector_meta


def _violations(check) -> list[str]:
    """The violations ``check()`` (a scenario that ends in ``OffloadInvariants.check``) reports."""
    with pytest.raises(AssertionError) as failure:
        check()
    return str(failure.value).split("\n  ")[1:]


def test_clean_cpu_tier_hit_checks_every_load_and_copy(plugin, adapter, feature):
    run = _run(adapter)
    assert _hit(adapter, run) == 336
    assert [(g, i, b) for _, _, g, i, b in run.invariants.loads] == LOADS
    # Every staged copy was compared with its source's keys when its event completed.
    assert run.invariants.published_checked == len(run.invariants.stores)
    assert run.invariants.violations == []


def test_copy_published_under_a_neighbours_key_fires(plugin, adapter, feature):
    swapped = []

    def swap_first_two_destinations(meta, manager):
        # The worker copies GPU block a into the CPU block published as b's copy, and back.
        if meta.store_event >= 0 and len(meta.store_cpu_blocks) >= 2 and not swapped:
            ids = list(meta.store_cpu_blocks)
            ids[0], ids[1] = ids[1], ids[0]
            meta.store_cpu_blocks = ids
            swapped.append((meta.store_event, list(meta.store_gpu_blocks[:2]), ids[:2]))

    run = _run(adapter, lambda engine: _wrap_meta(engine, swap_first_two_destinations))
    problems = _violations(lambda: _hit(adapter, run))
    [(event, (gpu_a, gpu_b), (cpu_a, cpu_b))] = swapped
    assert len(problems) == 2
    assert problems[0].split(" is published under ")[0].endswith(
        f"CPU block {cpu_a} (copy of GPU block {gpu_a}, store event {event})"
    )
    assert problems[1].split(" is published under ")[0].endswith(
        f"CPU block {cpu_b} (copy of GPU block {gpu_b}, store event {event})"
    )


def test_load_into_the_wrong_position_fires(plugin, adapter, feature):
    def swap_first_two_load_destinations(meta, manager):
        if meta.load_event >= 0:
            for req_id in meta.load_event_to_reqs[meta.load_event]:
                transfer = manager._reqs_to_load[req_id].transfer_meta
                ids = list(transfer.gpu_block_ids)
                ids[0], ids[1] = ids[1], ids[0]
                transfer.gpu_block_ids[:] = ids

    run = _run(adapter, lambda engine: _wrap_meta(engine, swap_first_two_load_destinations))
    problems = _violations(lambda: _hit(adapter, run))
    # Attention blocks 4 and 5 (boundaries 80 and 96) landed in each other's place.
    assert [p.split(" loads CPU block ")[1].split(" ", 1)[1] for p in problems] == [
        "into group 0 position 5 (tokens 80..96) but it carries boundaries [80]",
        "into group 0 position 4 (tokens 64..80) but it carries boundaries [96]",
    ]


def test_mamba_state_off_the_hit_boundary_fires(plugin, adapter, feature):
    """The state of 336 tokens is loaded for a hit the scheduler counts as 352: inside the block, not the hit."""
    run = _run(adapter)
    honest = run.invariants._observe_load

    def observe_a_hit_one_unit_higher(req_id, state):
        state.request.num_computed_tokens += 16
        try:
            honest(req_id, state)
        finally:
            state.request.num_computed_tokens -= 16

    run.invariants._observe_load = observe_a_hit_one_unit_higher
    problems = _violations(lambda: _hit(adapter, run))
    assert [p.split(" loads CPU block ")[1].split(" ", 1)[1] for p in problems] == [
        "into group 1 position 5 (tokens 320..384) but it carries boundaries [336], "
        "a Mamba state must be the one at the hit boundary 352"
    ]


def test_one_event_storing_a_block_twice_fires(plugin, adapter, feature):
    doubled = []

    def name_the_first_block_twice(meta, manager):
        if meta.store_event >= 0 and len(meta.store_gpu_blocks) >= 2 and not doubled:
            meta.store_gpu_blocks = [meta.store_gpu_blocks[0], *meta.store_gpu_blocks[:-1]]
            doubled.append(list(meta.store_gpu_blocks))

    run = _run(adapter, lambda engine: _wrap_meta(engine, name_the_first_block_twice))
    problems = _violations(lambda: _hit(adapter, run))
    assert problems[0].endswith(f"one store event names a GPU block twice: {doubled[0]}")


def test_blocks_left_referenced_at_idle_fire(plugin, adapter, feature):
    run = _run(adapter)
    _hit(adapter, run)
    cpu_pool, gpu_pool = run.invariants.cpu_pool, run.engine.gpu_block_pool
    start = run.invariants.cpu_free_at_start
    [cpu_block] = cpu_pool.get_new_blocks(1)
    [gpu_block] = gpu_pool.get_new_blocks(1)
    assert _violations(run.invariants.check) == [
        f"CPU pool: {start - 1} free blocks, {start} at start",
        f"GPU pool: blocks still referenced when idle: [{gpu_block.block_id}]",
    ]
    cpu_pool.free_blocks([cpu_block])
    gpu_pool.free_blocks([gpu_block])
    run.invariants.check()


# ---------------------------------------------------------------------- the per-step checker
def test_audit_pool_fires_on_a_block_freed_twice(plugin, adapter):
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=16)
    assert audit_pool(pool, "GPU") == []
    [block] = pool.get_new_blocks(1)
    block.ref_cnt = -1  # freed once more than it was referenced, still out of the free queue
    assert audit_pool(pool, "GPU") == [
        f"GPU pool: blocks freed more often than referenced (ref_cnt < 0): [{block.block_id}]",
    ]
    block.ref_cnt = 0  # unreferenced but never queued
    assert audit_pool(pool, "GPU") == [f"GPU pool: free queue [] referenced, [{block.block_id}] unreferenced but not free"]


@pytest.fixture
def harness(plugin, adapter):
    """The randomized suite's plugin variant, one request running."""
    h = FaultHarness(adapter, next(v for v in variants(adapter) if v.name == "plugin"), seed=0)
    h.add(0, 8, 0, 20, 4)
    h.step(2)
    assert h.violations == []
    return h


def test_reference_without_owner_fires(harness):
    pool = harness.engine.gpu_block_pool
    block_id = harness.engine.scheduler.kv_cache_manager.get_block_ids("q0")[0][0]
    owners = pool.blocks[block_id].ref_cnt
    pool.blocks[block_id].ref_cnt += 1  # a leaked reference
    harness.step()
    assert [v.split(": ", 1)[1] for v in harness.violations] == [
        f"GPU references without owner or owners without reference {{block: (ref_cnt, owners)}}: "
        f"{{{block_id}: ({owners + 1}, {owners})}}"
    ]
    pool.blocks[block_id].ref_cnt -= 1


def test_failed_load_counted_as_computed_fires(harness):
    invariants = harness.invariants
    request = harness.engine.scheduler.requests["q0"]
    invariants._verified["q0"] = 0
    invariants._start_watch(["q0"], set())
    assert invariants.violations == [
        f"step 2: q0: after its load failed it counts {request.num_computed_tokens} computed tokens, "
        "only 0 were verified locally"
    ]


def test_failed_load_destination_prefix_cached_fires(harness):
    invariants = harness.invariants
    request = harness.engine.scheduler.requests["q0"]
    block_id = harness.engine.scheduler.kv_cache_manager.get_block_ids("q0")[0][0]
    assert harness.engine.gpu_block_pool.blocks[block_id].block_hash is not None
    computed = request.num_computed_tokens
    invariants._watch.append(FailedLoad("q0", [(0, 0, block_id)]))
    request.num_computed_tokens = 0  # as if the load of block 0 failed and nothing was recomputed
    invariants._check_failed_loads()
    request.num_computed_tokens = computed
    assert invariants.violations == [
        f"step 2: q0: GPU block {block_id} (group 0 position 0) of a failed load is prefix-cached "
        "although the request computed only 0 tokens"
    ]


def test_outcome_counters_that_do_not_add_up_fire(harness):
    connector = harness.engine.connector
    honest = connector.get_boundary_store_stats

    def one_more_published():
        stats = honest()
        stats.published += 1
        return stats

    connector.get_boundary_store_stats = one_more_published
    before = honest().published
    harness.step()
    after = honest().published
    problems = [v.split(": ", 1)[1] for v in harness.violations]
    assert len(problems) == 1 + harness.invariants.consumes_handoffs
    assert problems[0].startswith(f"boundary-store outcomes do not add up: published {after + 1}, outcomes {{")
    if harness.invariants.consumes_handoffs:
        handoffs = after - before
        assert problems[1] == f"{handoffs} boundary hand-offs published this step, {handoffs + 1} outcomes counted"


def test_idle_leftovers_fire(harness):
    harness.drain()
    assert harness.violations == []
    manager = harness.engine.offload_manager
    [gpu_block] = harness.engine.gpu_block_pool.get_new_blocks(1)
    [cpu_block] = manager.cpu_block_pool.get_new_blocks(1)
    manager._reqs_to_store["ghost"] = "left behind"
    harness.invariants.check_idle()
    start = harness.invariants.offload.cpu_free_at_start
    assert [v.split(": ", 1)[1] for v in harness.violations] == [
        f"idle, but GPU blocks are still referenced: [{gpu_block.block_id}]",
        f"idle, but the CPU pool has {start - 1} free blocks ({start} at start)",
        "idle, but the connector still tracks {'_reqs_to_store': {'ghost': 'left behind'}}",
    ]
    del manager._reqs_to_store["ghost"]
    harness.engine.gpu_block_pool.free_blocks([gpu_block])
    manager.cpu_block_pool.free_blocks([cpu_block])


def test_restore_while_the_first_copy_is_in_flight_fires(plugin, adapter):
    """The event-aware "stored twice" check: a GPU block named again while its first copy is still copying."""
    h = FaultHarness(adapter, next(v for v in variants(adapter) if v.name == "plugin"), seed=0)
    h.set_faults(3, 0.0)
    first: list[tuple[int, int]] = []
    # The manager's metadata, inside the checker's own wrapper of the connector.
    manager = h.engine.offload_manager
    original = manager.build_connector_meta

    def store_again(scheduler_output):
        meta = original(scheduler_output)
        if meta.store_event >= 0 and not first:
            first.append((len(h.engine.steps), meta.store_gpu_blocks[0]))
        elif meta.store_event >= 0 and len(first) == 1 and first[0][1] not in meta.store_gpu_blocks:
            meta.store_gpu_blocks = [first[0][1], *meta.store_gpu_blocks[1:]]
            first.append((len(h.engine.steps), -1))
        return meta

    manager.build_connector_meta = store_again
    h.add(0, 8, 0, 20, 4)
    h.step(8)
    assert len(first) == 2
    step, gpu_id = first[0]
    assert [v for v in h.violations if "stored again" in v][0].split(": ", 1)[1].startswith(
        f"GPU block {gpu_id} stored again (first at step {step} into CPU block "
    )


# ---------------------------------------------------------------------- replay's loss attribution
def test_bucket_sum_check_fires_on_a_lost_token():
    from test_replay import assert_buckets_sum_to_the_loss

    row = {"ideal": 64, "reused": 16, "loss": {"no_mamba_state": 32}}
    result = SimpleNamespace(
        loss={"no_mamba_state": 32}, lost_tokens=48, ideal_tokens=64, reused_tokens=16,
        segments=[SimpleNamespace(per_request={"r0": row})],
    )
    with pytest.raises(AssertionError):
        assert_buckets_sum_to_the_loss(result)
    result.loss, row["loss"] = {"no_mamba_state": 48}, {"no_mamba_state": 48}
    assert_buckets_sum_to_the_loss(result)
