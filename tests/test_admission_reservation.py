"""An admission under deferred frees leaves the running prefills their blocks (patch ``admission_reserves_running_prefills``).

Requests ``a`` and ``b`` (512 tokens each, 64-token blocks, 128-token chunks) arrive together
on a 13-block pool, through the plugin's connector. Each fits alone; together their
first chunks leave ``a`` short of its next chunk. vLLM admits ``b`` anyway, ``a``
preempts it, and ``b`` computes its second chunk twice; under ``AsyncScheduler``
(which defers the preempted request's blocks a step) ``a`` also loses a step, and
in the soak such pairs preempted each other for ever (``test_reliability_regressions``).
With the patch ``b`` waits until ``a``'s prefill no longer needs the blocks.
The real scheduler of each wheel.
"""

from __future__ import annotations

import random

import pytest

from hybrid_kv_plugin.connector_names import CONNECTOR_NAME
from hybrid_kv_plugin.patches import admission_reserves_running_prefills
from hybrid_kv_plugin.sim.geometry import HybridGeometry

POOL = 13
PROMPT = 512
CHUNK = 128
CPU_BYTES = 4096 * 2048
# b's refused admissions, (step, blocks a still needs, free blocks): a needs 7 of the 9 its first
# chunk leaves, b's first chunk needs 3. The same on every wheel.
REFUSALS = [(0, 7, 9), (1, 5, 6), (2, 3, 3)]
# Tokens b is scheduled in all: its prompt and one decode, and, when it is preempted after two
# chunks, its second chunk again (it resumes from its 128-token prefix hit).
B_ONCE = PROMPT + 1
B_PREEMPTED = B_ONCE + CHUNK


def _engine(make_engine, **kwargs):
    def configure(vllm_config):
        vllm_config.scheduler_config.long_prefill_token_threshold = CHUNK
        vllm_config.scheduler_config.max_num_partial_prefills = 2

    geometry = HybridGeometry(
        attention_block_size=64, mamba_block_size=64, hash_block_size=16, num_gpu_blocks=POOL,
        max_model_len=1024, max_num_batched_tokens=4 * CHUNK,
    )
    engine = make_engine(
        geometry, kv_connector=CONNECTOR_NAME, kv_connector_extra_config={"cpu_bytes_to_use": CPU_BYTES}, configure=configure,
        **kwargs,
    )
    rng = random.Random(1)
    for request_id in ("a", "b"):
        engine.add_request(request_id, [rng.randrange(1, 30_000) for _ in range(PROMPT)], max_tokens=2)
    return engine


def _record_reservations(engine, monkeypatch) -> list[tuple[int, int, int]]:
    """(step, reserved blocks, free blocks) at each admission the patch reserves for; changes nothing."""
    count = admission_reserves_running_prefills.running_prefills_need
    pool = engine.gpu_block_pool
    seen: list[tuple[int, int, int]] = []

    def observed(scheduler, running):
        reserved = count(scheduler, running)
        seen.append((len(engine.steps), reserved, pool.get_num_free_blocks()))
        return reserved

    monkeypatch.setattr(admission_reserves_running_prefills, "running_prefills_need", observed)
    return seen


def _scheduled(engine, request_id: str) -> tuple[int, int]:
    """(first step that schedules the request, tokens scheduled for it in all)."""
    steps = [step.num_scheduled_tokens.get(request_id, 0) for step in engine.steps]
    return next(i for i, n in enumerate(steps) if n), sum(steps)


def _last_prefill_step(engine, request_id: str) -> int:
    return max(i for i, step in enumerate(engine.steps) if step.num_scheduled_tokens.get(request_id, 0) > 1)


@pytest.mark.parametrize("scheduling", ["async"], indirect=True)
def test_async_admission_waits_for_the_running_prefill(plugin, make_engine, scheduling, monkeypatch):
    engine = _engine(make_engine)
    assert engine.scheduler.defer_block_free  # overlapping batches and a connector that loads KV
    seen = _record_reservations(engine, monkeypatch)
    engine.run_until_idle(max_steps=60)
    assert engine.outcomes["a"].finished and engine.outcomes["b"].finished
    assert seen[1:4] == REFUSALS  # seen[0]: a's own admission, nothing running (0 of 12 free)
    assert seen[0] == (0, 0, POOL - 1)
    first_b, b_tokens = _scheduled(engine, "b")
    assert first_b > _last_prefill_step(engine, "a") and b_tokens == B_ONCE


@pytest.mark.parametrize("scheduling", ["async"], indirect=True)
def test_without_the_reservation_b_is_preempted(plugin, make_engine, scheduling, monkeypatch):
    # The patch's count zeroed (the plugin's code, not vLLM's): vLLM's own admission as it was.
    monkeypatch.setattr(admission_reserves_running_prefills, "running_prefills_need", lambda scheduler, running: 0)
    engine = _engine(make_engine)
    engine.run_until_idle(max_steps=60)
    assert engine.steps[0].num_scheduled_tokens == {"a": CHUNK, "b": CHUNK}
    assert engine.steps[2].num_scheduled_tokens == {}  # a short of blocks; b's, deferred, not yet free
    assert _scheduled(engine, "b") == (0, B_PREEMPTED)


def test_scheduler_that_frees_at_once_keeps_vllms_admission(plugin, make_engine, monkeypatch):
    # Under Scheduler a preemption frees its blocks within the step: the wheel's method is bound on
    # the engine's KVCacheManager past the patch, and b goes in with a.
    engine = _engine(make_engine)
    seen = _record_reservations(engine, monkeypatch)
    manager = engine.scheduler.kv_cache_manager
    assert getattr(manager.allocate_slots, "__hybrid_kv_patch__", None) != "admission_reserves_running_prefills"
    engine.run_until_idle(max_steps=60)
    assert seen == []
    assert engine.steps[0].num_scheduled_tokens == {"a": CHUNK, "b": CHUNK}
    assert _scheduled(engine, "b") == (0, B_PREEMPTED)


@pytest.mark.parametrize("scheduling", ["async"], indirect=True)
def test_switch_off_keeps_vllms_admission(plugin, make_engine, scheduling, monkeypatch):
    engine = _engine(make_engine, additional_config={"hybrid_kv": {"async_load_liveness": False}})
    seen = _record_reservations(engine, monkeypatch)
    engine.run_until_idle(max_steps=60)
    assert seen == []
    assert _scheduled(engine, "b") == (0, B_PREEMPTED)
