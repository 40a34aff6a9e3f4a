"""HybridSimpleCPUConnector plumbing on every wheel: outcome counters and their Prometheus series,
the worker-side store submission on steps without a forward pass, the engine loop keeping
alive for queued stores, the 0.33 CPU-pool sizing gate, and the adapter facts behind them."""

from __future__ import annotations

import functools
import types

import pytest

from hybrid_kv_plugin import CONNECTOR_NAME
from hybrid_kv_plugin.adapters import Feature, Support
from hybrid_kv_plugin.config import PluginConfigError
from hybrid_kv_plugin.connector_names import STOCK_CONNECTOR_NAME
from hybrid_kv_plugin.patches import patch_specs

from helpers import tokens
from scenarios.offload import offload_engine

EXPECTED_SUPPORT = {
    "0.26.0": Support.BACKPORT,
    "0.27.1": Support.BACKPORT,
    "0.28.0": Support.BACKPORT,
    "0.29.0": Support.BACKPORT,
}
SAVE_OUTCOMES = "vllm:simple_kv_offload_save_outcomes_total"
# The manifest's patches that serve CPU offload (the hand-off channel of 0.26-0.28, the 0.33 sizing gate).
OFFLOAD_PATCHES = ("offload_", "mamba_boundary_handoffs", "boundary_handoff_publish", "truncate_mamba_lookup")


def _support(adapter) -> Support:
    return adapter.verdict(Feature.FINE_GRAINED_CPU_HITS).support


@pytest.fixture
def feature(adapter):
    support = _support(adapter)
    assert support is not Support.UNAVAILABLE  # backported on 0.26-0.29, native from 0.30
    return support


def test_adapter_verdict_and_patches(adapter):
    assert _support(adapter) is EXPECTED_SUPPORT.get(adapter.version, Support.NATIVE)
    names = [spec.name for spec in patch_specs(adapter) if spec.name.startswith(OFFLOAD_PATCHES)]
    if adapter.boundary_handoff_patch_needed:  # 0.26-0.28: the hand-off channel of 0.29
        assert names == [
            "mamba_boundary_handoffs.cache_blocks",
            "mamba_boundary_handoffs.allocate_new_blocks",
            "mamba_boundary_handoffs.pop_blocks_for_free",
            "mamba_boundary_handoffs.new_step_starts",
            "boundary_handoff_publish",
            *(["truncate_mamba_lookup"] if adapter.version.startswith("0.27.") else []),
        ]
        return
    assert names == (["offload_has_connector"] if adapter.version.startswith("0.33.") else [])


def test_unknown_option_names_the_allowed_keys(plugin, adapter):
    with pytest.raises(PluginConfigError) as bad:
        offload_engine(adapter, CONNECTOR_NAME, extra={"fine_grained_hit": True})
    assert "kv_connector_extra_config.fine_grained_hit: unknown key (allowed keys: cpu_tier_eviction, cpu_tier_request_ends, fine_grained_hits)" in str(bad.value)
    with pytest.raises(PluginConfigError, match=r"fine_grained_hits: .*allowed: true or false"):
        offload_engine(adapter, CONNECTOR_NAME, extra={"fine_grained_hits": "yes"})


def _backport_refusal(what: str, adapter) -> str:
    return (
        f"hybrid-kv-plugin: the fine-grained SimpleCPU backport reads {what}, "
        f"which vLLM {adapter.version} does not have; set "
        '"fine_grained_hits": false in kv_connector_extra_config to run the stock SimpleCPU connector.'
    )


def test_backport_refuses_a_block_without_the_hash_slots_it_reads(plugin, adapter, feature, monkeypatch):
    """The backport's per-block loops read KVCacheBlock's hash slots; a wheel without them stops start-up."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    if feature is not Support.BACKPORT:
        run = offload_engine(adapter)  # native: the wheel's own scheduler side, which needs no slot
        assert type(run.engine.connector.scheduler_manager).__name__ == "SimpleCPUOffloadScheduler"
        return
    slots = tuple(name for name in KVCacheBlock.__slots__ if name != "_block_hash_num_tokens")
    monkeypatch.setattr(KVCacheBlock, "__slots__", slots)  # a changed wheel, as the check sees it
    with pytest.raises(PluginConfigError) as refused:
        offload_engine(adapter)
    assert str(refused.value) == _backport_refusal("KVCacheBlock slot(s) _block_hash_num_tokens", adapter)
    monkeypatch.undo()
    # Its "already on the CPU tier" test reads the CPU map's dict: a wheel whose map keeps no
    # plain dict there stops start-up the same way.
    from vllm.v1.core.block_pool import BlockHashToBlockMap

    stock_init = BlockHashToBlockMap.__init__

    def init_without_a_dict(self, *args, **kwargs):
        stock_init(self, *args, **kwargs)
        self._cache = types.MappingProxyType(self._cache)

    monkeypatch.setattr(BlockHashToBlockMap, "__init__", init_without_a_dict)
    with pytest.raises(PluginConfigError) as refused:
        offload_engine(adapter)
    assert str(refused.value) == _backport_refusal("BlockHashToBlockMap._cache (a dict)", adapter)
    monkeypatch.undo()
    run = offload_engine(adapter)
    assert type(run.engine.connector.scheduler_manager).__name__ == "FineGrainedOffloadScheduler"


# ---------------------------------------------------------------------- outcome counters
class _Inject:
    """Adds hand-off entries to the first step whose real hand-offs name request ``req_id``."""

    def __init__(self, run, req_id: str, extra_for_req, others):
        self.done = False
        connector = run.engine.connector
        original = connector.build_connector_meta

        def build_connector_meta(scheduler_output):
            state = scheduler_output.kv_connector_block_state
            offers = state.boundary_state_offloads if state is not None else {}
            if not self.done and req_id in offers:
                self.done = True
                offers[req_id] = [*offers[req_id], *extra_for_req(offers[req_id])]
                offers.update(others)
            return original(scheduler_output)

        connector.build_connector_meta = build_connector_meta


def _stats_sink(run) -> list:
    """What the real scheduler collects from the connector's stats hook each step."""
    collected = []
    connector = run.engine.connector
    original = connector.get_kv_connector_stats

    def get_kv_connector_stats():
        stats = original()
        if stats is not None and not stats.is_empty():
            collected.append(stats)
        return stats

    connector.get_kv_connector_stats = get_kv_connector_stats
    return collected


def _block_hashes(engine, prompt):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    request = Request(
        request_id="hash-probe",
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=engine.block_hasher,
    )
    return request.block_hashes


def test_every_outcome_counted_and_exported(plugin, adapter, feature):
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    run = offload_engine(adapter)
    engine = run.engine
    sink = _stats_sink(run)
    other = tokens(320, offset=7)
    run.request(other, max_tokens=4)  # its blocks are now on the CPU tier, and still cached on the GPU
    before = engine.connector.get_boundary_store_stats().as_dict()
    gpu_pool = engine.gpu_block_pool
    first_key = make_block_hash_with_group_id(_block_hashes(engine, other)[0], 0)
    cached_on_cpu = gpu_pool.cached_block_hash_to_block.get_one_block(first_key).block_id
    never_hashed = next(b.block_id for b in reversed(gpu_pool.blocks) if b.block_hash is None and b.ref_cnt == 0)

    def extra(real):
        (group, tail_block, boundary), = real
        return [
            (group, tail_block, boundary),  # the same block again: in flight
            (group, 0, 64),  # the null block
            (group, never_hashed, 128),
            (0, cached_on_cpu, 16),
        ]

    injector = _Inject(run, "r1", extra, {"ghost": [(1, 5, 64), (1, 6, 128)]})
    assert run.request(tokens(336), max_tokens=4) == 0
    assert injector.done
    after = engine.connector.get_boundary_store_stats().as_dict()
    # 0.26-0.27 keep the whole-block Mamba state at 320 too: r1 hands it off (stored) as well.
    own = 2 if adapter.version in ("0.26.0", "0.27.1") else 1
    assert {k: after[k] - before[k] for k in after} == {
        "published": own + 6,  # r1's own hand-offs + 6 injected
        "stored": own,
        "dropped_cpu_full": 0,
        "dropped_request_gone": 2,
        "skipped_already_cached": 1,
        "skipped_in_flight": 1,
        "dropped_null_block": 1,
        "dropped_not_hashed": 1,
        "declined_request_end": 0,
    }
    run.invariants.check()

    # The same totals reach Prometheus through vLLM's own connector-stats path.
    registry = CollectorRegistry()
    metric_types = {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    prom = type(engine.connector).build_prom_metrics(engine.vllm_config, metric_types, ["engine"], {0: ["0"]})
    total = functools.reduce(lambda a, b: a.aggregate(b), sink)
    prom.observe(total.data, engine_idx=0)
    outcomes = [k for k in after if k != "published"]
    exported = {k: registry.get_sample_value(SAVE_OUTCOMES, {"engine": "0", "outcome": k}) for k in outcomes}
    assert exported == {k: float(after[k]) if after[k] else None for k in outcomes}


def test_cpu_full_drops_the_handoff(plugin, adapter, feature):
    # One CPU block: the null block. Ends stored (auto, the default, would decline the one at 336:
    # a tier with no free block has started evicting).
    run = offload_engine(adapter, extra={"cpu_bytes_to_use": 1024, "cpu_tier_request_ends": "store"})
    assert run.engine.offload_manager.cpu_block_pool.get_num_free_blocks() == 0
    run.request(tokens(336), max_tokens=4)
    stats = run.engine.connector.get_boundary_store_stats()
    own = 2 if adapter.version in ("0.26.0", "0.27.1") else 1  # + the whole-block state at 320 there
    assert (stats.published, stats.dropped_cpu_full, stats.stored) == (own, own, 0)
    run.invariants.check()


def test_stock_modes_report_zero_stats(plugin, adapter):
    import dataclasses

    run = offload_engine(adapter, CONNECTOR_NAME, extra={"fine_grained_hits": False})
    run.request(tokens(336), max_tokens=4)
    connector = run.engine.connector
    stats = connector.get_boundary_store_stats().as_dict()
    if _support(adapter) is Support.NATIVE:  # opting out cannot switch a native wheel off: vLLM's own counters
        # (plus the plugin's own outcome, declined_request_end: 0, this run's tier never fills)
        native = dataclasses.asdict(connector.scheduler_manager.get_boundary_store_stats())
        assert stats == {**native, "declined_request_end": 0}
    else:
        assert stats == dict.fromkeys(stats, 0)
        assert connector.get_kv_connector_stats() is None
    run.invariants.check()


# ---------------------------------------------------------------------- stores queued at finish
# Blocks A (320-token prompt, max_tokens=1) still had to store when it finished. From
# 0.32 the prefill stops at 304, so all but one block were stored while it ran.
FINISH_STORE_BLOCKS = {"0.26.0": 20, "0.27.1": 20, "0.28.0": 20, "0.29.0": 20, "0.30.0": 20, "0.31.0": 20, "0.32.0": 1, "0.33.0": 1}


def test_engine_keeps_stepping_for_stores_queued_at_finish(plugin, adapter, feature):
    """The step after A finishes has nothing to compute; it must carry (and the engine must wait for) A's stores."""
    native = _support(adapter) is Support.NATIVE
    for connector, queued in ((CONNECTOR_NAME, True), (STOCK_CONNECTOR_NAME, native)):
        run = offload_engine(adapter, connector)
        engine = run.engine
        engine.add_request("a", tokens(320), max_tokens=1)
        while "a" in engine.scheduler.requests:
            engine.step()
        assert engine.connector.has_pending_push_work() is queued, connector
        record = engine.step()
        assert record.num_scheduled_tokens == {}
        assert (record.store_event is not None) is queued
        assert engine.connector.has_pending_push_work() is False
        assert engine.scheduler.has_requests() is False
        run.invariants.check()


def _worker_connector(mocker, engine, connector_cls):
    """The connector in WORKER role with a real SimpleCPU worker; only the DMA copy engine is mocked."""
    import torch
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    worker = connector_cls(engine.vllm_config, KVConnectorRole.WORKER, engine.kv_cache_config)
    worker.worker_handler._backend = mocker.Mock(name="DmaCopyBackend")
    mocker.patch.object(torch.cuda, "current_stream")  # no CUDA on this machine
    mocker.patch.object(torch, "Event")
    mocker.patch.object(kv_transfer_state, "_KV_CONNECTOR_AGENT", worker)
    return worker


def test_stores_sent_on_steps_without_forward(plugin, adapter, feature, mocker):
    """vLLM 0.29's runner never calls wait_for_save() without a forward pass; the plugin submits on clear."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
        SimpleCPUOffloadConnector,
    )
    from vllm.forward_context import set_forward_context
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin as Runner

    run = offload_engine(adapter)
    engine = run.engine
    outputs = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: outputs.append(schedule()) or outputs[-1]
    engine.add_request("a", tokens(320), max_tokens=1)
    engine.run_until_idle()
    finish_step = outputs[-1]  # nothing to compute: only the stores queued when A finished
    assert finish_step.num_scheduled_tokens == {}
    meta = finish_step.kv_connector_metadata
    assert len(meta.store_gpu_blocks) == FINISH_STORE_BLOCKS[adapter.version]
    run.invariants.check()

    plugin_cls = KVConnectorFactory.get_connector_class(engine.vllm_config.kv_transfer_config)
    stock_launches = int(adapter.simplecpu_worker_submits_without_forward)
    for cls, launches in ((plugin_cls, 1), (SimpleCPUOffloadConnector, stock_launches)):
        worker = _worker_connector(mocker, engine, cls)
        Runner.kv_connector_no_forward(finish_step, engine.vllm_config)
        stores = [c for c in worker.worker_handler._backend.launch_copy.call_args_list if c.kwargs["is_store"]]
        assert len(stores) == launches, cls.__name__
        if launches:
            assert stores[0].args == (meta.store_gpu_blocks, meta.store_cpu_blocks)
    # A step with a forward pass submits once, and not again when the metadata is cleared.
    worker = _worker_connector(mocker, engine, plugin_cls)
    with set_forward_context(None, engine.vllm_config), Runner.maybe_get_kv_connector_output(finish_step):
        pass
    assert [c.kwargs["is_store"] for c in worker.worker_handler._backend.launch_copy.call_args_list] == [True]


# ---------------------------------------------------------------------- 0.33 CPU pool sizing gate
def test_engine_core_sizing_gate_sees_the_plugin_connector(no_plugin, adapter):
    from vllm.config import KVTransferConfig

    import hybrid_kv_plugin

    direct = KVTransferConfig(kv_connector=CONNECTOR_NAME, kv_role="kv_both")
    nested = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": [{"kv_connector": CONNECTOR_NAME, "kv_role": "kv_both"}]},
    )
    if not hasattr(KVTransferConfig, "has_connector"):
        # 0.26-0.28: no name gate to satisfy; the adapter knows none and the plugin adds no method.
        assert adapter.simplecpu_block_count_gated_by_name is False
        hybrid_kv_plugin.register()
        assert not hasattr(KVTransferConfig, "has_connector")
        return
    assert direct.has_connector(STOCK_CONNECTOR_NAME) is False
    hybrid_kv_plugin.register()
    gated = adapter.simplecpu_block_count_gated_by_name
    assert direct.has_connector(STOCK_CONNECTOR_NAME) is gated
    assert nested.has_connector(STOCK_CONNECTOR_NAME) is gated
    assert direct.has_connector("NixlConnector") is False
    assert direct.has_connector(CONNECTOR_NAME) is True
