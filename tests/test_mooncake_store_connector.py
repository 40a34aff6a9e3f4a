"""HybridMooncakeStoreConnector on the stock wheels, which have no Mooncake client installed.

On every wheel 0.26-0.33 the connector is registered by name and, named in a real
``VllmConfig``, refuses at start-up with one message naming what is missing; doctor shows
the same. Its options are checked field by field. The store tier (threads, deadline,
circuit breaker, counters) runs against a stand-in store client here: a Python object with
the four calls the tier makes, some of which block the way a client does while its master
is down. The real client and two real engines: tests/engine/test_mooncake_cluster.py.
"""

from __future__ import annotations

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
        self.closed = False
        self.refusals = 0  # the next puts answered "full" (Mooncake's -200), as while its master evicts

    def _wait(self) -> None:
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
    tier = _tier(store, clock, max_queued_puts=1)
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
        # The first batch blocks in its reader, so the queue (size 1) holds the second; the third is dropped.
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
