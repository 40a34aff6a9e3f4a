"""A prefix hit that makes a request too large for the whole pool (patch ``local_hit_admission``).

vLLM admits a waiting request only if its whole sequence fits, counted with its
local hit, and a hit ending inside a Mamba block costs more blocks than no hit.
Request ``a`` (49 tokens) leaves vLLM's own prompt-tail Mamba state at 48; request
``b`` extends it to 383 tokens (``max_model_len`` 384, 64-token blocks). On a
10-block pool ``b`` runs to the end without a hit on every wheel, but with the
48-token hit it needs 10 free blocks of the 9 there are: stock vLLM asks again
every step and never admits it (nothing else runs). The real scheduler of each wheel.
"""

from __future__ import annotations

import logging
import random

import pytest

from hybrid_kv_plugin.connector_names import CONNECTOR_NAME
from hybrid_kv_plugin.sim.geometry import HybridGeometry

MAX_MODEL_LEN = 384
POOL = 10  # b alone (no hit) completes here on every wheel
POOL_WITH_ROOM = 11  # the hit's extra block fits
CPU_BYTES = 4096 * 2048
HIT = 48  # vLLM's prompt-tail state of a 49-token prompt: the last 16-token boundary below it
PROMPT = [random.Random(0).randrange(1, 30_000) for _ in range(MAX_MODEL_LEN - 1)]
WARNING = (
    "hybrid-kv-plugin: a request's prefix-cache hit needs more KV blocks than the whole pool holds; such requests "
    "are recomputed without the cache (raise the KV cache size or lower max_model_len)"
)


def _geometry(num_gpu_blocks):
    return HybridGeometry(
        attention_block_size=64, mamba_block_size=64, hash_block_size=16, num_gpu_blocks=num_gpu_blocks,
        max_model_len=MAX_MODEL_LEN,
    )


def _engine(make_engine, num_gpu_blocks, ahead_of_b=()):
    engine = make_engine(_geometry(num_gpu_blocks))
    assert engine.run([("a", PROMPT[:49])]) == {"a": 0}
    for request_id, tokens, max_tokens in ahead_of_b:
        engine.add_request(request_id, tokens, max_tokens=max_tokens)
    engine.add_request("b", PROMPT, max_tokens=1)
    return engine


def test_alone_b_runs_on_this_pool(no_plugin, make_engine):
    engine = make_engine(_geometry(POOL))
    assert engine.run([("b", PROMPT)]) == {"b": 0}


def test_stock_never_admits_b_with_its_hit(no_plugin, make_engine):
    engine = _engine(make_engine, POOL)
    with pytest.raises(RuntimeError, match="did not go idle within 50 steps"):
        engine.run_until_idle(max_steps=50)
    request = engine.scheduler.requests["b"]
    pool = engine.gpu_block_pool
    # Nothing runs, every block is free, and b is still waiting with nothing computed.
    assert (request.status.name, request.num_computed_tokens, engine.scheduler.running) == ("WAITING", 0, [])
    assert pool.get_num_free_blocks() == POOL - 1
    assert engine.scheduler.kv_cache_manager.get_computed_blocks(request)[1] == HIT


def test_plugin_recomputes_b_without_the_hit(plugin, make_engine, plugin_log):
    engine = _engine(make_engine, POOL)
    steps_before = len(engine.steps)
    engine.run_until_idle(max_steps=50)
    assert engine.outcomes["b"].finished and engine.outcomes["b"].hit_tokens == 0
    # One step refuses b with the hit, then its prefill runs in full (chunks cut for Mamba states at
    # 320 and 368) and the engine takes one more step to go idle: the same on every wheel.
    assert [step.num_scheduled_tokens for step in engine.steps[steps_before:]] == [{}, {"b": 320}, {"b": 48}, {"b": 15}, {}]
    warnings = [r.getMessage() for r in plugin_log.records if r.levelno == logging.WARNING]
    assert warnings == [WARNING]


def test_plugin_recomputes_b_without_the_hit_through_its_connector(plugin, adapter, make_engine, monkeypatch):
    # With a KV connector 0.26 looks a hybrid request up group by group (its connector path), a lookup
    # that does not read skip_reading_prefix_cache: connector_hit_reconcile drops the hit there too.
    from hybrid_kv_plugin.patches import connector_hit_reconcile

    def b_with_the_connector():
        engine = make_engine(_geometry(POOL), kv_connector=CONNECTOR_NAME, kv_connector_extra_config={"cpu_bytes_to_use": CPU_BYTES})
        assert engine.run([("a", PROMPT[:49])]) == {"a": 0}
        engine.add_request("b", PROMPT, max_tokens=1)
        steps_before = len(engine.steps)
        engine.run_until_idle(max_steps=50)
        return engine.outcomes["b"].hit_tokens, [step.num_scheduled_tokens for step in engine.steps[steps_before:]]

    assert b_with_the_connector() == (0, [{}, {"b": 320}, {"b": 48}, {"b": 15}, {}])
    installed = any(spec.name == "connector_hit_reconcile" for spec in plugin.patch_set.specs)
    assert installed == adapter.connector_lookup_takes_deepest_group  # 0.26
    if installed:
        monkeypatch.setattr(connector_hit_reconcile, "reads_no_cache", lambda block_hashes: False)
        with pytest.raises(RuntimeError, match="did not go idle within 50 steps"):
            b_with_the_connector()


def test_plugin_keeps_a_hit_that_fits(plugin, make_engine, plugin_log):
    engine = _engine(make_engine, POOL_WITH_ROOM)
    engine.run_until_idle(max_steps=50)
    assert engine.outcomes["b"].finished and engine.outcomes["b"].hit_tokens == HIT
    assert [r for r in plugin_log.records if r.levelno == logging.WARNING] == []


def test_without_the_fix_the_plugin_hangs_too(plugin, make_engine, monkeypatch):
    from hybrid_kv_plugin.patches import local_hit_admission

    monkeypatch.setattr(local_hit_admission, "read_no_cache", lambda request: None)
    engine = _engine(make_engine, POOL)
    with pytest.raises(RuntimeError, match="did not go idle within 50 steps"):
        engine.run_until_idle(max_steps=50)
    assert engine.scheduler.requests["b"].num_computed_tokens == 0


def test_plugin_keeps_a_hit_refused_while_another_request_runs(plugin, make_engine, plugin_log):
    # c (200 other tokens, 4 decode steps) goes first and holds blocks: b with its hit does not fit
    # beside it, and is admitted with the hit once c is done.
    other = [random.Random(1).randrange(1, 30_000) for _ in range(200)]
    engine = _engine(make_engine, POOL_WITH_ROOM, ahead_of_b=[("c", other, 4)])
    steps_before = len(engine.steps)
    engine.run_until_idle(max_steps=50)
    assert engine.outcomes["b"].finished and engine.outcomes["b"].hit_tokens == HIT
    scheduled = [step.num_scheduled_tokens for step in engine.steps[steps_before:]]
    # Refused for five steps while c runs (the pool is not empty), then admitted at its 48-token hit.
    assert scheduled == [
        {"c": 192}, {"c": 8}, {"c": 1}, {"c": 1}, {"c": 1}, {"b": 16}, {"b": 256}, {"b": 48}, {"b": 15}, {}
    ]
    assert [r for r in plugin_log.records if r.levelno == logging.WARNING] == []


# Under AsyncScheduler (a GPU `vllm serve`'s default) the Mamba manager frees a request's previous
# state block a step later. From 0.31 it counts a chunk's new blocks as it allocates them and the
# same program behaves as above; stock 0.26-0.30 count one block more for b's last chunk (it resumes
# from vLLM's prompt-tail state at 368, inside a block), so b cannot finish on this pool, hit or not
# (the plugin's vLLM fix mamba_chunk_count_capped counts it as 0.31 does: below).


@pytest.mark.parametrize("scheduling", ["async"], indirect=True)
def test_async_b_alone_on_this_pool(no_plugin, make_engine, adapter):
    engine = make_engine(_geometry(POOL))
    engine.add_request("b", PROMPT, max_tokens=1)
    if adapter.mamba_chunk_count_capped:
        engine.run_until_idle(max_steps=50)
        assert engine.outcomes["b"].finished and engine.outcomes["b"].hit_tokens == 0
        assert [step.num_scheduled_tokens for step in engine.steps] == [{"b": 320}, {"b": 48}, {"b": 15}, {}, {}, {}]
        return
    # vLLM's own: preempted at its last 15 tokens, then refused with its own 368-token hit for ever.
    with pytest.raises(RuntimeError, match="did not go idle within 40 steps"):
        engine.run_until_idle(max_steps=40)
    request = engine.scheduler.requests["b"]
    assert [step.num_scheduled_tokens for step in engine.steps[:3]] == [{"b": 320}, {"b": 48}, {}]
    assert (request.status.name, request.num_computed_tokens) == ("PREEMPTED", 0)
    assert engine.gpu_block_pool.get_num_free_blocks() == POOL - 1


@pytest.mark.parametrize("scheduling", ["async"], indirect=True)
def test_async_b_alone_finishes_with_the_plugin(plugin, make_engine, adapter, monkeypatch):
    """vLLM fix ``mamba_chunk_count_capped`` (0.26-0.30; 0.31+ natively): b's last chunk resumes
    from the state at 368, inside its running block, holds every block it needs and owes only the
    copy of that state. Counted the one block it takes, b finishes where stock 0.26-0.30 (above)
    preempts it at that chunk for ever."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    engine = make_engine(_geometry(POOL))
    counts: list[tuple[int, int]] = []  # (the wheel's own count, the count the scheduler gets)
    count = MambaManager.get_num_blocks_to_allocate
    wheels_count = getattr(count, "__wrapped__", count)  # the patch wraps it on 0.26-0.30

    def counted(self, request_id, *args, **kwargs):
        # The wheel's count first: it only records the chunk's checkpoint, as the patched call does again.
        own = wheels_count(self, request_id, *args, **kwargs)
        counts.append((own, count(self, request_id, *args, **kwargs)))
        return counts[-1][1]

    engine.add_request("b", PROMPT, max_tokens=1)
    monkeypatch.setattr(MambaManager, "get_num_blocks_to_allocate", counted)
    engine.run_until_idle(max_steps=50)
    assert engine.outcomes["b"].finished and engine.outcomes["b"].hit_tokens == 0
    assert [step.num_scheduled_tokens for step in engine.steps] == [{"b": 320}, {"b": 48}, {"b": 15}, {}, {}, {}]
    # The Mamba group's counts per call (admission, then the three chunks): the 15-token chunk's is
    # 1 block, the copy it takes; the wheel's own count there is 2 on 0.26-0.30.
    last_chunk_own = 1 if adapter.mamba_chunk_count_capped else 2
    assert counts == [(1, 1), (1, 1), (1, 1), (last_chunk_own, 1)]


@pytest.mark.parametrize("scheduling", ["async"], indirect=True)
def test_async_plugin_recomputes_b_without_the_hit(plugin, make_engine, adapter, plugin_log):
    # With the plugin every wheel counts b's last chunk as it allocates it (0.31+ natively, 0.26-0.30
    # through the vLLM fix mamba_chunk_count_capped): b, its hit dropped once, finishes as under Scheduler,
    # then the async engine's two steps to drain its queue.
    engine = _engine(make_engine, POOL)
    steps_before = len(engine.steps)
    engine.run_until_idle(max_steps=50)
    assert engine.outcomes["b"].finished and engine.outcomes["b"].hit_tokens == 0
    scheduled = [step.num_scheduled_tokens for step in engine.steps[steps_before:]]
    assert scheduled == [{}, {"b": 320}, {"b": 48}, {"b": 15}, {}, {}, {}]
    warnings = [r.getMessage() for r in plugin_log.records if r.levelno == logging.WARNING]
    assert warnings == [WARNING]
