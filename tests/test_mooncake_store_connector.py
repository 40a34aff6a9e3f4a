"""HybridMooncakeStoreConnector on the stock wheels, which have no Mooncake client installed.

On every wheel 0.26-0.33 the connector is registered by name and, named in a real
``VllmConfig``, refuses at start-up with one message naming what is missing; doctor shows
the same. Its options are checked field by field. The store tier (threads, deadline,
circuit breaker, counters) runs against a stand-in store client here: a Python object with
the four calls the tier makes, some of which block the way a client does while its master
is down. The real client and two real engines: tests/engine/test_mooncake_cluster.py.
"""

from __future__ import annotations

import queue
import threading

import pytest

from hybrid_kv_plugin.config import PluginConfigError
from hybrid_kv_plugin.connector_names import STORE_CONNECTOR_NAME
from hybrid_kv_plugin.mooncake_store.options import StoreOptions
from hybrid_kv_plugin.mooncake_store.tier import STORE_FULL, StoreTier, decode, encode

REFUSAL = (
    "HybridMooncakeStoreConnector needs the Mooncake store client, which does not import here "
    "(No module named 'mooncake'); install it: pip install 'hybrid-kv-plugin[mooncake]' "
    "(PyPI mooncake-transfer-engine-non-cuda; it needs the system library libibverbs.so.1, "
    "Debian/Ubuntu: apt-get install libibverbs1)"
)
MINIMAL = {"master": "127.0.0.1:50051", "metadata_server": "http://127.0.0.1:8080/metadata"}


def test_connector_is_registered_by_name(plugin):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    assert STORE_CONNECTOR_NAME in KVConnectorFactory._registry


def test_start_up_refuses_without_mooncake(plugin, adapter):
    """Every stock wheel: the connector class imports; building it stops with the one message."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from hybrid_kv_plugin.sim import HybridGeometry
    from hybrid_kv_plugin.sim.geometry import build_vllm_config

    vllm_config = build_vllm_config(
        HybridGeometry(), adapter, kv_connector=STORE_CONNECTOR_NAME,
        kv_connector_extra_config={"cpu_bytes_to_use": 1 << 22, "mooncake_store": dict(MINIMAL)},
    )  # fmt: skip
    connector_class = KVConnectorFactory.get_connector_class(vllm_config.kv_transfer_config)
    assert connector_class.__name__ == STORE_CONNECTOR_NAME
    with pytest.raises(PluginConfigError) as refused:
        connector_class(vllm_config, KVConnectorRole.SCHEDULER, None)
    assert str(refused.value) == REFUSAL
    # Start-up left the configuration as it was.
    assert vllm_config.kv_transfer_config.kv_connector_extra_config["mooncake_store"] == MINIMAL


def test_doctor_shows_the_refusal(adapter):
    from hybrid_kv_plugin.cli.doctor import collect

    row = collect().mooncake_store
    assert (row["feature"], row["support"], row["reason"]) == ("mooncake_store_tier", "unavailable", REFUSAL)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (None, "kv_connector_extra_config.mooncake_store is required, "
               '{"master": "HOST:PORT", "metadata_server": "http://HOST:PORT/metadata", ...}'),
        ({"master": "127.0.0.1:1"}, "kv_connector_extra_config.mooncake_store.metadata_server is required"),
        (MINIMAL | {"lookup_timeout": 5}, "kv_connector_extra_config.mooncake_store: unknown key(s) lookup_timeout; "
         "allowed: master, metadata_server, local_hostname, protocol, rdma_devices, global_segment_bytes, "
         "local_buffer_bytes, lookup_timeout_ms, retry_s, max_queued_puts"),
        (MINIMAL | {"lookup_timeout_ms": 0}, "kv_connector_extra_config.mooncake_store.lookup_timeout_ms: 0 is not a positive int"),
        (MINIMAL | {"retry_s": "5"}, "kv_connector_extra_config.mooncake_store.retry_s: '5' is not a positive float"),
        (MINIMAL | {"master": 50051}, "kv_connector_extra_config.mooncake_store.master: 50051 is not a string"),
        (MINIMAL | {"global_segment_bytes": 4 << 20}, "kv_connector_extra_config.mooncake_store.global_segment_bytes: "
         "4194304 is below 16777216 (16 MiB), the Mooncake client's smallest segment"),
    ],
)  # fmt: skip
def test_bad_options_are_refused(section, message):
    extra = {} if section is None else {"mooncake_store": section}
    with pytest.raises(PluginConfigError) as refused:
        StoreOptions.from_extra(extra)
    assert str(refused.value) == "invalid hybrid-kv-plugin configuration: " + message


def test_options_defaults():
    options = StoreOptions.from_extra({"mooncake_store": MINIMAL | {"retry_s": 2}})
    assert (options.local_hostname, options.protocol, options.lookup_timeout_ms, options.retry_s) == ("127.0.0.1", "tcp", 1000, 2)
    assert (options.global_segment_bytes, options.local_buffer_bytes, options.max_queued_puts) == (256 << 20, 64 << 20, 256)


def test_value_format_round_trips():
    assert decode(encode(432, b"\x01\x02")) == (432, b"\x01\x02")
    assert decode(encode(None, b"")) == (None, b"")


class StandInStore:
    """The four calls StoreTier makes, in memory; ``hang`` makes every call wait, as a client does
    while its master is down, until ``release`` is set."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.hang = threading.Event()
        self.release = threading.Event()
        self.entered = threading.Event()  # a call has begun
        self.closed = False
        self.refusals = 0  # the next puts answered "full" (Mooncake's -200), as while its master evicts

    def _wait(self) -> None:
        self.entered.set()
        if self.hang.is_set():
            self.release.wait(timeout=10)

    def put(self, key: str, value: bytes) -> int:
        self._wait()
        if self.hang.is_set():
            return -900
        if self.refusals:
            self.refusals -= 1
            return STORE_FULL
        self.values[key] = bytes(value)
        return 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self._wait()
        if self.hang.is_set():
            return [-1] * len(keys)
        return [int(key in self.values) for key in keys]

    def get_batch(self, keys: list[str]) -> list[bytes]:
        return [self.values.get(key, b"") for key in keys]

    def close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _tier(store: StandInStore, clock: Clock, max_queued_puts: int = 4, full_wait_s: float = 0.5) -> StoreTier:
    tier = StoreTier(
        lambda: store, "ns", lookup_timeout_s=0.5, retry_s=2.0, max_queued_puts=max_queued_puts,
        full_wait_s=full_wait_s, clock=clock,
    )  # fmt: skip
    for _ in range(500):
        if tier.available():
            break
        threading.Event().wait(0.01)
    assert tier.available()
    return tier


def _wait(condition, what: str) -> None:
    for _ in range(1000):
        if condition():
            return
        threading.Event().wait(0.01)
    raise AssertionError(what)


def test_put_then_lookup_finds_the_bytes():
    store, clock = StandInStore(), Clock()
    tier = _tier(store, clock)
    try:
        released = threading.Event()
        key = tier.key_of(b"\xab\xcd")
        assert key == "ns/abcd"
        assert tier.offer([([(key, 432)], lambda: b"state")], released.set)
        _wait(tier.idle, "the put thread wrote the block")
        assert released.is_set() and store.values == {key: encode(432, b"state")}
        job = tier.lookup([key, "ns/ef"])
        _wait(job.done.is_set, "the lookup finished")
        assert (job.found, job.absent, job.error) == ({key: (432, b"state")}, {"ns/ef"}, "")
        counters = tier.counters()
        assert (counters.blocks_put, counters.keys_put, counters.bytes_put) == (1, 1, 5)
        assert (counters.lookups, counters.keys_found, counters.keys_absent, counters.bytes_fetched) == (1, 1, 1, 5)
        assert counters.breaker_trips == counters.puts_dropped == 0
    finally:
        tier.close()
    assert store.closed


def test_master_down_lookup_expires_and_breaker_opens():
    """A lookup stuck in the client is abandoned at its deadline; lookups and puts are then answered at
    once (counted) until the breaker's window ends; the window over, the store is used again."""
    store, clock = StandInStore(), Clock()
    tier = _tier(store, clock)
    try:
        store.hang.set()
        job = tier.lookup(["ns/01"])
        _wait(store.entered.is_set, "the lookup thread called the store")  # the call runs from 100.0 on
        clock.now += 0.4
        assert not tier.expired(job)  # still inside its deadline: the scheduler is told "not yet"
        clock.now += 0.2
        assert tier.expired(job)
        assert not tier.available()
        assert tier.lookup(["ns/02"]) is None
        released = threading.Event()
        assert not tier.offer([([("ns/03", None)], lambda: b"x")], released.set)
        assert not released.is_set()  # the caller unpins: nothing was queued
        counters = tier.counters()
        assert (counters.lookups, counters.lookup_timeouts, counters.lookups_skipped) == (1, 1, 1)
        assert counters.lookups_expired_queued == 0
        assert (counters.breaker_trips, counters.puts_dropped) == (1, 1)
        assert tier.last_failure == "lookup unfinished after 0.5 s"
        store.hang.clear()
        store.release.set()
        _wait(job.done.is_set, "the stuck call returned")
        assert tier.counters().lookup_ms == 600  # an abandoned lookup's time still counts once it returns
        clock.now += 2.0
        assert tier.available()
        store.values["ns/04"] = encode(16, b"y")
        again = tier.lookup(["ns/04"])
        _wait(again.done.is_set, "the lookup after the window")
        assert again.found == {"ns/04": (16, b"y")}
    finally:
        tier.close()


def test_failed_put_opens_the_breaker_and_full_queue_drops():
    store, clock = StandInStore(), Clock()
    tier = _tier(store, clock, max_queued_puts=2)
    try:
        store.hang.set()
        store.release.set()  # calls return at once, failing
        assert tier.offer([([("ns/01", None)], lambda: b"a")], lambda: None)
        _wait(lambda: tier.counters().put_failures == 1, "the put failed")
        assert not tier.available()
        assert tier.counters().breaker_trips == 1
        assert tier.last_failure == "put failed: -900"  # the store's own code, named in the warning
        clock.now += 2.0
        store.hang.clear()
        gate = threading.Event()
        # The first batch blocks in its reader and the second waits: two blocks wait (the limit); the third is dropped.
        assert tier.offer([([("ns/02", None)], lambda: gate.wait(10) and b"b")], lambda: None)
        _wait(lambda: tier._puts.qsize() == 0, "the put thread took the first batch")
        assert tier.offer([([("ns/03", None)], lambda: b"c")], lambda: None)
        assert not tier.offer([([("ns/04", None)], lambda: b"d")], lambda: None)
        gate.set()
        _wait(tier.idle, "both batches written")
        assert sorted(store.values) == ["ns/02", "ns/03"]
        counters = tier.counters()
        assert (counters.blocks_put, counters.put_failures, counters.puts_dropped) == (2, 1, 1)
    finally:
        tier.close()


def test_full_store_is_waited_for_then_counted_never_a_fault():
    """A put refused for space is retried while the store evicts: it lands after 3 refusals; one still
    refused after ``full_wait_s`` (5 retries of 10 ms) is dropped and counted. The breaker stays closed,
    and the dropped key is a plain miss for a reader."""
    store, clock = StandInStore(), Clock()
    tier = _tier(store, clock, full_wait_s=0.05)
    try:
        store.refusals = 3
        assert tier.offer([([("ns/01", 16)], lambda: b"a")], lambda: None)
        _wait(tier.idle, "the put landed")
        store.refusals = 1000
        assert tier.offer([([("ns/02", 32)], lambda: b"bb")], lambda: None)
        _wait(tier.idle, "the put gave up")
        store.refusals = 0
        assert tier.available()
        job = tier.lookup(["ns/01", "ns/02"])
        _wait(job.done.is_set, "the lookup finished")
        assert (job.found, job.absent, job.error) == ({"ns/01": (16, b"a")}, {"ns/02"}, "")
        counters = tier.counters()
        assert (counters.blocks_put, counters.put_full_retries, counters.puts_store_full) == (1, 3 + 5, 1)
        assert (counters.put_failures, counters.breaker_trips, counters.lookup_errors) == (0, 0, 0)
        assert (counters.keys_found, counters.keys_absent) == (1, 1)
    finally:
        tier.close()


class GatedStore(StandInStore):
    """Each ``batch_is_exist`` waits until the test opens its gate (one Event per call, in call order)."""

    def __init__(self) -> None:
        super().__init__()
        self.gates: queue.Queue = queue.Queue()

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        gate = threading.Event()
        self.gates.put(gate)
        gate.wait(10)
        return super().batch_is_exist(keys)


def test_lookup_that_waited_behind_healthy_lookups_is_dropped_without_opening_the_breaker():
    """Three lookups queued together; the store answers each in 400 ms (stand-in clock). At 600 ms the
    second (in the store for 200 ms) and the third (still queued) are past their 500 ms deadline: both are
    abandoned, the breaker stays closed, and the store is never asked for the third."""
    store, clock = GatedStore(), Clock()
    tier = _tier(store, clock)
    try:
        store.values["ns/a"] = encode(16, b"a")
        jobs = [tier.lookup([key]) for key in ("ns/a", "ns/b", "ns/c")]
        first = store.gates.get(timeout=5)  # the first lookup is in the store from 100.0 on
        clock.now += 0.4
        first.set()
        second = store.gates.get(timeout=5)  # the first answered at 100.4; the second is in the store
        assert jobs[0].done.is_set() and jobs[0].found == {"ns/a": (16, b"a")}
        clock.now += 0.2
        assert tier.expired(jobs[2]) and tier.expired(jobs[1])
        assert tier.available() and tier.last_failure == ""
        second.set()
        _wait(jobs[2].done.is_set, "the lookup thread dropped the third lookup")
        assert store.gates.empty()  # the third was never sent to the store
        assert (jobs[2].found, jobs[2].absent, jobs[2].error) == ({}, set(), "")
        counters = tier.counters()
        assert (counters.lookups, counters.lookups_expired_queued, counters.lookup_timeouts) == (3, 2, 0)
        assert (counters.breaker_trips, counters.lookup_errors, counters.lookups_skipped) == (0, 0, 0)
        assert counters.lookup_ms == 400 + 600 + 600
    finally:
        tier.close()


def test_reader_that_raises_neither_stops_the_put_thread_nor_keeps_blocks_pinned():
    """A block reader raising (a tensor copy failing) is one failed put: the breaker opens, the
    batch's blocks are released, and after the window the next batch is written by the same thread."""
    store, clock = StandInStore(), Clock()
    tier = _tier(store, clock)
    try:
        released = [threading.Event(), threading.Event()]

        def broken_reader() -> bytes:
            raise MemoryError("copy failed")

        assert tier.offer([([("ns/01", None)], broken_reader)], released[0].set)
        _wait(tier.idle, "the failed batch was taken off the queue")
        assert released[0].is_set() and not tier.available()
        assert tier.last_failure == "put failed: MemoryError('copy failed')"
        clock.now += 2.0
        assert tier.offer([([("ns/02", 8)], lambda: b"b")], released[1].set)
        _wait(tier.idle, "the next batch was written")
        assert released[1].is_set() and store.values == {"ns/02": encode(8, b"b")}
        counters = tier.counters()
        assert (counters.put_failures, counters.breaker_trips, counters.blocks_put) == (1, 1, 1)
    finally:
        tier.close()


class MortalStore(StandInStore):
    """A client whose process can die: every call then raises, as the agent's closed pipe does, and
    ``alive()`` says so. Stores made by one factory share their keys, as clients of one master do."""

    def __init__(self, values: dict[str, bytes]) -> None:
        super().__init__()
        self.values = values
        self.dead = False

    def alive(self) -> bool:
        return not self.dead

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        if self.dead:
            raise EOFError("store agent closed its pipe")
        return super().batch_is_exist(keys)


def test_client_whose_process_died_is_replaced_once():
    """The agent dies: the failed lookup opens the breaker, the dead client is closed and a new one set up
    (once, not per failure); after the window a lookup finds what the master still holds."""
    values: dict[str, bytes] = {"ns/01": encode(16, b"a")}
    made: list[MortalStore] = []

    def connect() -> MortalStore:
        made.append(MortalStore(values))
        return made[-1]

    clock = Clock()
    tier = StoreTier(connect, "ns", lookup_timeout_s=0.5, retry_s=2.0, max_queued_puts=4, clock=clock)
    try:
        _wait(lambda: tier._client is not None, "the first client is set up")
        made[0].dead = True
        job = tier.lookup(["ns/01"])
        _wait(job.done.is_set, "the failed lookup")
        assert job.error == "EOFError('store agent closed its pipe')"
        _wait(lambda: len(made) == 2 and tier._client is made[1], "a new client is set up")
        assert made[0].closed and not tier.available()  # the breaker is still open
        clock.now += 2.0
        again = tier.lookup(["ns/01"])
        _wait(again.done.is_set, "the lookup through the new client")
        assert again.found == {"ns/01": (16, b"a")}
        counters = tier.counters()
        assert (counters.clients_replaced, counters.lookup_errors, counters.breaker_trips) == (1, 1, 1)
        assert len(made) == 2
    finally:
        tier.close()
    assert made[1].closed


def test_namespace_tells_weights_and_layouts_apart(adapter):
    """Real VllmConfig and KVCacheConfig of the installed wheel: the same model under another revision,
    quantization or KV-cache dtype gets other keys; the same configuration the same keys."""
    from hybrid_kv_plugin.mooncake_store.connector import _namespace
    from hybrid_kv_plugin.sim import HybridGeometry
    from hybrid_kv_plugin.sim.geometry import build_kv_cache_config, build_vllm_config

    geometry = HybridGeometry()

    def namespace(**changes: str) -> str:
        config = build_vllm_config(geometry, adapter)
        for name, value in changes.items():
            owner = config.cache_config if name == "cache_dtype" else config.model_config
            setattr(owner, name, value)
        return _namespace(config, build_kv_cache_config(geometry, adapter))

    base = namespace()
    assert base == namespace() and base.startswith("hkv-") and len(base) == 20
    others = [namespace(revision="v2"), namespace(quantization="fp8"), namespace(cache_dtype="fp8")]
    assert len({base, *others}) == 4


def test_blocks_waiting_for_the_put_thread_are_bounded_in_blocks():
    """``max_queued_puts`` counts blocks, not batches: with 4, a 3-block batch held in its reader leaves room
    for one more block only; once it is read, a 4-block batch fits; a batch larger than the limit goes when
    nothing waits."""
    store, clock = StandInStore(), Clock()
    tier = _tier(store, clock, max_queued_puts=4)
    try:
        gate = threading.Event()

        def batch(name: str, blocks: int, read=lambda: b"x") -> list:
            return [([(f"ns/{name}{i}", None)], read) for i in range(blocks)]

        assert tier.offer(batch("a", 3, lambda: gate.wait(10) and b"a"), lambda: None)
        assert not tier.offer(batch("b", 2), lambda: None)  # 3 + 2 > 4
        assert tier.offer(batch("c", 1), lambda: None)  # 3 + 1
        assert not tier.offer(batch("d", 1), lambda: None)
        gate.set()
        _wait(tier.idle, "both batches written")
        assert tier.offer(batch("e", 4), lambda: None)
        _wait(tier.idle, "the 4-block batch written")
        assert tier.offer(batch("f", 6), lambda: None)  # alone: larger than the limit, nothing else waits
        _wait(tier.idle, "the 6-block batch written")
        counters = tier.counters()
        assert (counters.blocks_put, counters.puts_dropped) == (3 + 1 + 4 + 6, 2 + 1)
        assert sorted(store.values) == sorted(f"ns/{n}{i}" for n, k in (("a", 3), ("c", 1), ("e", 4), ("f", 6)) for i in range(k))
    finally:
        tier.close()
