"""The behaviours of vLLM PR #54736 (seed 000), on the real scheduler of every wheel that has the feature.

On 0.26-0.29 they come from the plugin's backport, on 0.30+ from vLLM itself behind the
same connector name; each test asserts the same numbers on both. On 0.26-0.28 the
backport runs on the boundary hand-off channel the plugin adds to those wheels.
"""

from __future__ import annotations

import logging

import pytest

from hybrid_kv_plugin.adapters import Feature, Support
from hybrid_kv_plugin.connector_names import STOCK_CONNECTOR_NAME
from hybrid_kv_plugin.offload.mode import OffloadMode
from hybrid_kv_plugin.sim import HybridGeometry

from helpers import tokens
from scenarios.nixl_pair import has_mamba_cache_mode
from scenarios.offload import CONTINUATION, cpu_tier_hit, gpu_local_hit, offload_engine

FA32 = HybridGeometry(attention_block_size=32)
# The prompt whose Mamba prompt-tail state sits at 336 tokens: the last hash boundary
# of the prompt up to 0.31, the last one <= N-1 from 0.32 (see the table test).
# 0.26-0.27 keep a Mamba state at every whole 64-token block (no sparse retention), so the
# state at 320 is handed off (and stored) too; 0.28+ keep only the prompt-tail state.
KEEPS_EVERY_MAMBA_BLOCK = ("0.26.0", "0.27.1")
PROMPT_WITH_TAIL_AT_336 = {"0.26.0": 336, "0.27.1": 336, "0.28.0": 336, "0.29.0": 336, "0.30.0": 336, "0.31.0": 336, "0.32.0": 352, "0.33.0": 352}


@pytest.fixture
def feature(adapter):
    support = adapter.verdict(Feature.FINE_GRAINED_CPU_HITS).support
    assert support is not Support.UNAVAILABLE  # backported on 0.26-0.29, native from 0.30
    return support


def _group_of(key) -> int:
    from vllm.v1.core.kv_cache_utils import get_group_id

    return get_group_id(key)


class StepLog:
    """Per step: the boundary hand-offs the scheduler published and the GPU blocks the store event names."""

    def __init__(self, run):
        self.handoffs: list[list[tuple[int, int, int]]] = []  # (group, block id, boundary tokens)
        self.stores: list[list[int]] = []
        self.metadata: list[object] = []
        connector, manager = run.engine.connector, run.engine.offload_manager
        original = connector.build_connector_meta

        def build_connector_meta(scheduler_output):
            state = scheduler_output.kv_connector_block_state
            offers = state.boundary_state_offloads if state is not None else {}
            meta = original(scheduler_output)
            self.handoffs.append([tuple(entry) for entries in offers.values() for entry in entries])
            self.stores.append(list(meta.store_gpu_blocks))
            self.metadata.append(_store_metadata(manager, meta.store_event) if meta.store_event >= 0 else None)
            return meta

        connector.build_connector_meta = build_connector_meta


def _store_metadata(manager, event: int):
    """Per-block metadata of a store event in flight: the backport's records, or vLLM's ``block_meta``."""
    from hybrid_kv_plugin.offload.fine_grained_scheduler import FineGrainedOffloadScheduler

    if isinstance(manager, FineGrainedOffloadScheduler):
        return manager.store_metadata(event)
    return manager._store_event_to_blocks[event].block_meta


# ---------------------------------------------------------------------- geometry
def test_group_block_sizes_from_coordinator(plugin, adapter, feature):
    for geometry, sizes in ((HybridGeometry(), (16, 64)), (FA32, (32, 64))):
        run = offload_engine(adapter, geometry=geometry)
        manager = run.engine.offload_manager
        assert manager.group_block_sizes == sizes
        assert adapter.offload_group_block_sizes(manager.cpu_coordinator) == sizes
        assert manager.fa_block_size == sizes[0]


def test_positional_stability_contract(adapter, make_engine):
    """Attention tables are append-only; a Mamba ``align`` table is not (nulled interiors, relocated slots)."""
    managers = make_engine().scheduler.kv_cache_manager.coordinator.single_type_managers
    assert [adapter.offload_positionally_stable(m) for m in managers] == [True, False]


@pytest.mark.parametrize(("mamba_cache_mode", "cursor"), [("align", [5, 0]), ("all", [5, 5])])
def test_dcp_store_cursor_uses_resolved_sizes(plugin, adapter, feature, mamba_cache_mode, cursor):
    """DCP 4: attention blocks are 64 tokens, Mamba stays 64 (not 256); align Mamba is never scanned."""

    def dcp4(vllm_config):
        vllm_config.parallel_config.decode_context_parallel_size = 4

    if not has_mamba_cache_mode(mamba_cache_mode):  # 'all' from 0.32 on
        return
    geometry = HybridGeometry(mamba_cache_mode=mamba_cache_mode)
    run = offload_engine(adapter, geometry=geometry, configure=dcp4)
    engine = run.engine
    if mamba_cache_mode == "all" and adapter.version in KEEPS_EVERY_MAMBA_BLOCK:
        # These wheels cannot run this geometry with any connector, the plugin's included: the
        # first connector lookup asserts (block_size % hash_block_size) in resolve_block_hashes.
        stock = offload_engine(adapter, STOCK_CONNECTOR_NAME, geometry=geometry, configure=dcp4).engine
        for wheel_engine in (stock, engine):
            wheel_engine.add_request("a", tokens(336), max_tokens=4)
            with pytest.raises(AssertionError):
                wheel_engine.step()
        return
    engine.add_request("a", tokens(336), max_tokens=4)
    for _ in range(3):  # prefill, then two decodes: 336 tokens confirmed at the third store pass
        engine.step()
    assert engine.offload_manager._reqs_to_store["a"].num_stored_blocks == cursor
    engine.run_until_idle()
    run.invariants.check()


# ---------------------------------------------------------------------- load path
@pytest.mark.both_schedulers
def test_fine_grained_external_hit_mapping(plugin, adapter, feature):
    """64 tokens hit locally; the CPU tier supplies the rest, each block at its own position."""
    n = PROMPT_WITH_TAIL_AT_336[adapter.version]
    run = offload_engine(adapter)
    hit = cpu_tier_hit(run, tokens(n), warm=[tokens(64)])
    assert hit == 336 == gpu_local_hit(adapter, tokens(n))
    assert run.engine.outcomes["r2"].external_tokens == 336 - 64
    # (group, destination index, prefix boundary of the key the CPU block carries):
    # attention blocks 4..20 (local blocks 0..3 stay on the GPU), the Mamba state of
    # 336 tokens in Mamba block 5 (= 336 // 64), found from local 64 // 64 = 1 onwards.
    assert [(g, i, boundary) for _, _, g, i, boundary in run.invariants.loads] == [
        *((0, i, (i + 1) * 16) for i in range(4, 21)),
        (1, 5, 336),
    ]


def test_misaligned_local_prefix_skips_the_cpu_tier(plugin, adapter, feature, plugin_log):
    n = PROMPT_WITH_TAIL_AT_336[adapter.version]
    run = offload_engine(adapter)
    run.request(tokens(n), max_tokens=4)
    engine = run.engine
    request = engine.add_request("probe", [*tokens(n), *CONTINUATION])
    manager = engine.offload_manager
    assert manager.get_num_new_matched_tokens(request, 48) == (0, False)
    assert manager.get_num_new_matched_tokens(request, 48) == (0, False)
    assert manager.get_num_new_matched_tokens(request, 64) == (336 - 64, True)
    if feature is Support.BACKPORT:
        assert plugin_log.messages(logging.WARNING) == [
            "hybrid-kv-plugin: SimpleCPU skips the CPU lookup when the local prefix (48 tokens here) "
            "is not a multiple of the scheduler block size 64"
        ]
    engine.run_until_idle()  # the scheduler's own lookup releases the probe's pin
    assert engine.outcomes["probe"].hit_tokens == 336
    run.invariants.check()


def test_fine_grained_hits_require_eager_offload(plugin, adapter, feature):
    """Lazy offload keeps CPU hits on the scheduler block: 320, where eager serves 336."""
    n = PROMPT_WITH_TAIL_AT_336[adapter.version]
    hits = {}
    for lazy in (False, True):
        run = offload_engine(adapter, extra={"lazy_offload": lazy})
        assert run.engine.offload_manager.cpu_coordinator.enable_partial_hash_hits is (not lazy)
        run.request(tokens(320), max_tokens=4)
        run.request(tokens(n), max_tokens=4)
        run.engine.step()  # an idle step: lazy mode offloads from the GPU free queue here
        assert run.engine.reset_prefix_cache()
        hits[lazy] = run.request([*tokens(n), *CONTINUATION])
        run.invariants.check()
    assert hits == {False: 336, True: 320}


# ---------------------------------------------------------------------- store path
# Under AsyncScheduler the prefill's output arrives after the first decode is scheduled, and
# 0.26-0.31 then keyed the prompt tail a second time on the running Mamba block, which already
# holds the state after 337 (one more hand-off of 336, a later state under that key): the plugin's
# vLLM fix prompt_tail_keyed_once stops that, so A's prompt tail is handed off once under both
# schedulers (tests/test_prompt_tail_keyed_once.py shows stock vLLM).


@pytest.mark.both_schedulers
def test_mamba_blocks_never_scanned_positionally(plugin, adapter, feature, scheduling):
    """Every Mamba block that reaches the CPU tier is one the scheduler handed off in that step."""
    n = PROMPT_WITH_TAIL_AT_336[adapter.version]
    run = offload_engine(adapter)
    log = StepLog(run)
    engine = run.engine
    engine.add_request("a", tokens(n), max_tokens=4)
    mamba_blocks = set()  # every block that was ever in A's Mamba table
    while engine.has_work():
        if "a" in engine.scheduler.requests:
            mamba_blocks.update(engine.scheduler.kv_cache_manager.get_block_ids("a")[1])
        engine.step()
    offered = [[(block, boundary) for group, block, boundary in step if group == 1] for step in log.handoffs]
    mamba_blocks.update(block for step in offered for block, _ in step)
    stored_mamba = [[b for b in stored if b in mamba_blocks] for stored in log.stores]
    assert stored_mamba == [[block for block, _ in step] for step in offered]
    # Exactly the Mamba states the GPU keeps leave: the prompt-tail state of 336 tokens
    # (and the whole-block state at 320 where the wheel keeps one).
    expected = [320, 336] if adapter.version in KEEPS_EVERY_MAMBA_BLOCK else [336]
    assert [boundary for step in offered for _, boundary in step] == expected
    assert sum(map(len, stored_mamba)) == len(expected)
    run.invariants.check()


@pytest.mark.both_schedulers
def test_attention_partial_tail_stored_once(plugin, adapter, feature):
    """FA block 32: the prompt-tail boundary 336 is inside attention block 10 (320..352)."""
    n = PROMPT_WITH_TAIL_AT_336[adapter.version]
    for max_tokens in (4, 17):  # 17: decode fills block 10 before the request finishes
        run = offload_engine(adapter, geometry=FA32)
        run.request(tokens(n), max_tokens=max_tokens)
        attention_stores = [s for s in run.invariants.stores if _group_of(s.key) == 0]
        # Blocks 0..9 and block 10 (the tail), each once.
        assert len(attention_stores) == 11
        assert len({s.gpu_block_id for s in attention_stores}) == 11
        assert run.engine.reset_prefix_cache()
        assert run.request([*tokens(n), *CONTINUATION]) == 336
        loads = [(g, i) for _, _, g, i, _ in run.invariants.loads]
        assert loads == [*((0, i) for i in range(11)), (1, 5)]
        run.invariants.check()


@pytest.mark.both_schedulers
def test_answer_blocks_stored_once_confirmed(plugin, adapter, feature):
    """Each attention block the answer fills is stored, once its tokens are confirmed: under
    AsyncScheduler a step later (the computed tokens include output placeholders, not yet hashed)."""
    n = PROMPT_WITH_TAIL_AT_336[adapter.version]
    run = offload_engine(adapter)
    run.request(tokens(n), max_tokens=40)
    attention = [s.key_tokens for s in run.invariants.stores if _group_of(s.key) == 0]
    # The last sampled token is never computed: n + 39 tokens of KV, whole 16-token blocks stored.
    assert sorted(attention) == [16 * (i + 1) for i in range((n + 39) // 16)]
    run.invariants.check()


def test_boundary_metadata_index_parallel_with_kv_events(plugin, adapter, feature):
    """With KV events on, a store mixing a hand-off and positional blocks keeps one metadata entry per block."""
    from vllm.config import KVEventsConfig

    def kv_events(vllm_config):
        vllm_config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")

    run = offload_engine(adapter, configure=kv_events)
    log = StepLog(run)
    events = []
    take_events = run.engine.connector.take_events

    def capture():
        taken = list(take_events())
        events.extend((len(run.engine.steps), e) for e in taken)
        return taken

    run.engine.connector.take_events = capture
    n = PROMPT_WITH_TAIL_AT_336[adapter.version]
    run.request(tokens(n), max_tokens=4)
    mixed = [i for i, (stored, offered) in enumerate(zip(log.stores, log.handoffs)) if offered and len(stored) > len(offered)]
    assert len(mixed) == 1
    step = mixed[0]
    stored, metadata = log.stores[step], log.metadata[step]
    # 0.28+: the prompt-tail hand-off + attention blocks 0..20; 0.26-0.27 stored blocks
    # 0..19 one step earlier, so only block 20 rides with the hand-off.
    attention = 1 if adapter.version in KEEPS_EVERY_MAMBA_BLOCK else 21
    assert len(stored) == len(metadata) == 1 + attention
    assert stored[0] == log.handoffs[step][0][1]
    payloads = [_payload_tokens(entry) for entry in metadata]
    assert payloads == [0] + [16] * attention  # the hand-off carries no token payload
    # The store completes within its step (the simulated worker reports it at once).
    stored_events = [e for i, e in events if i == step and type(e).__name__ == "BlockStored" and e.medium == "CPU"]
    assert [(e.group_idx, e.block_size, len(e.token_ids)) for e in stored_events] == [(1, 64, 0)] + [(0, 16, 16)] * attention
    run.invariants.check()


def _payload_tokens(entry) -> int:
    if isinstance(entry, dict):  # vLLM 0.30+: {hash: BlockStoreMeta}
        return sum(len(meta.token_ids) for meta in entry.values())
    return len(entry.token_ids)  # the backport's StagedBlock


# ---------------------------------------------------------------------- counters
# After A and its continuation B = A + 3 tokens: A hands
# off its prompt-tail state (stored); B hands off its own prompt tail, which is A's
# state again up to 0.31 (already cached) and the later boundary 352 from 0.32.
# 0.26-0.27 publish one more: with mamba_allocated_mark a copy-on-write of a request's own prompt-tail
# state runs the running-request path, which hands it off (a state already cached). (published,
# stored, already cached) per wheel.
STATS_AFTER_REPLAY = {"0.26.0": (3, 2, 1), "0.27.1": (3, 2, 1), "0.28.0": (2, 1, 1), "0.29.0": (2, 1, 1),
                      "0.30.0": (2, 1, 1), "0.31.0": (2, 1, 1), "0.32.0": (2, 2, 0), "0.33.0": (2, 2, 0)}


@pytest.mark.both_schedulers
def test_boundary_store_stats_same_fields_everywhere(plugin, adapter, feature, scheduling):
    n = PROMPT_WITH_TAIL_AT_336[adapter.version]
    run = offload_engine(adapter)
    connector = run.engine.connector
    assert connector.offload_mode in (OffloadMode.BACKPORT, OffloadMode.NATIVE)
    cpu_tier_hit(run, tokens(n))
    published, stored, already_cached = STATS_AFTER_REPLAY[adapter.version]
    assert connector.get_boundary_store_stats().as_dict() == {
        "published": published,
        "stored": stored,
        "dropped_cpu_full": 0,
        "dropped_request_gone": 0,
        "skipped_already_cached": already_cached,
        "skipped_in_flight": 0,
        "dropped_null_block": 0,
        "dropped_not_hashed": 0,
        "declined_request_end": 0,
    }
