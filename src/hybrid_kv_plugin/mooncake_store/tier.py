"""The Mooncake store as a second tier behind one engine's SimpleCPU tier, never on the step's path.

Invariants:
- No store call runs on the caller's thread: client setup, puts and lookups each run on
  a daemon thread of their own; the scheduler only queues work and polls finished jobs.
  A master that is down (each call then takes seconds) costs a step a queue operation.
- A lookup that has not finished within ``lookup_timeout_s`` is abandoned (counted). The
  circuit breaker opens for ``retry_s`` when the store is the cause: any store error, or the
  store owing the lookup thread its current answer for ``lookup_timeout_s`` (from that job's
  queueing, or from the end of the job before it). Lookups are then answered "nothing" at once and
  puts are dropped (both counted); the first call after that window probes again. A lookup that
  waited its deadline out behind other healthy lookups opens nothing and, if still queued,
  is never sent.
- At most ``max_queued_puts`` blocks wait for the put thread (queued, or being read), so a
  store slower than the engine pins a bounded part of the CPU tier; past that a batch is
  dropped (counted), unless nothing waits (a larger batch then goes alone).
- Nothing a store call, a block reader or a release raises stops the put or lookup thread.
  A client that reports itself gone (``alive()`` False: its process died) is closed and a
  new one set up, once per client; the store is unavailable meanwhile.
- A full store is no fault: a put the store refuses for space (:data:`STORE_FULL`) is
  retried on the put thread while the master evicts (its oldest objects first), at most
  ``full_wait_s``, then dropped and counted; the breaker stays closed, and a key the store
  evicted is a plain miss for every reader.
- A value is ``8-byte little-endian num_tokens (-1: None) + the block's bytes``; its key is
  ``<namespace>/<block hash with group id, hex>``. The namespace names the model and the
  block layout, so two models sharing a master never read each other's bytes.
- Counters only grow; :meth:`StoreTier.counters` returns a copy.
"""

from __future__ import annotations

import logging
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

_HEADER = struct.Struct("<q")
logger = logging.getLogger("hybrid_kv_plugin.mooncake_store")
# Mooncake's NO_AVAILABLE_HANDLE: no segment has room for the object. Measured (0.3.13.post1,
# default master): the master then evicts 5% of its objects, oldest first, and a retry 10-25 ms
# later lands.
STORE_FULL = -200
FULL_RETRY_S = 0.01


@dataclass
class StoreCounters:
    """What the store tier did, cumulative."""

    blocks_put: int = 0  # blocks written (one block may be written under several keys)
    keys_put: int = 0
    bytes_put: int = 0
    put_failures: int = 0
    puts_dropped: int = 0  # not written: breaker open, client not ready, or queue full
    put_full_retries: int = 0  # puts the store refused for space, retried while it evicts
    puts_store_full: int = 0  # blocks not written: still refused for space after ``full_wait_s``
    lookups: int = 0  # jobs sent to the store
    keys_found: int = 0
    keys_absent: int = 0
    bytes_fetched: int = 0
    lookup_errors: int = 0
    lookup_timeouts: int = 0  # abandoned at the deadline while the store was answering them (breaker opened)
    lookups_expired_queued: int = 0  # abandoned at the deadline, the store not slow (it waited behind others)
    lookup_ms: int = 0  # lookups' time, queued to answered (or dropped unasked), summed (mean: lookup_ms / lookups)
    lookups_skipped: int = 0  # answered "nothing" at once: breaker open or client not ready
    breaker_trips: int = 0
    blocks_installed: int = 0  # fetched blocks placed in the local CPU tier
    setup_failures: int = 0
    clients_replaced: int = 0  # clients set up again after theirs was gone (its process died)


@dataclass
class LookupJob:
    """Keys asked for; ``found`` maps key -> (num_tokens, payload) once ``done`` is set."""

    keys: list[str]
    started: float
    done: threading.Event = field(default_factory=threading.Event)
    found: dict[str, tuple[int | None, bytes]] = field(default_factory=dict)
    absent: set[str] = field(default_factory=set)
    error: str = ""
    abandoned: bool = False  # the caller stopped waiting (its deadline passed); a queued job is then dropped


def encode(num_tokens: int | None, payload: bytes) -> bytes:
    return _HEADER.pack(-1 if num_tokens is None else num_tokens) + payload


def decode(value: bytes) -> tuple[int | None, bytes]:
    (num_tokens,) = _HEADER.unpack_from(value)
    return (None if num_tokens < 0 else num_tokens), value[_HEADER.size :]


class StoreTier:
    """A store client behind three threads (setup, puts, lookups) and a circuit breaker.

    ``connect`` builds and sets up a client (it may block for as long as the master takes);
    the client needs ``put(key, bytes) -> int``, ``batch_is_exist(keys) -> list[int]``,
    ``get_batch(keys) -> list[bytes]`` and ``close()``, as ``MooncakeDistributedStore`` has,
    and may have ``alive() -> bool`` (False: it will never answer again).
    """

    def __init__(
        self,
        connect: Callable[[], Any],
        namespace: str,
        *,
        lookup_timeout_s: float,
        retry_s: float,
        max_queued_puts: int,
        full_wait_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.namespace = namespace
        self.full_wait_s = full_wait_s
        self.lookup_timeout_s = lookup_timeout_s
        self.retry_s = retry_s
        self._clock = clock
        self._connect = connect
        self._lock = threading.Lock()
        self._counters = StoreCounters()
        self._client: Any = None
        self._open_until = 0.0
        self.last_failure = ""  # why the breaker last opened, for the log and for tests
        self._closed = threading.Event()
        self.max_queued_puts = max_queued_puts  # in blocks
        self._waiting_blocks = 0  # offered, not yet released by the put thread
        self._puts: queue.Queue = queue.Queue()
        self._lookups: queue.Queue = queue.Queue()
        # When the store began to owe the lookup thread its current answer: the job's queueing time, or
        # the end of the job before it where it waited behind that one (None: no call in progress).
        self._serving_since: float | None = None
        self._threads = [
            threading.Thread(target=self._setup_loop, name="hybrid-kv-store-setup", daemon=True),
            threading.Thread(target=self._put_loop, name="hybrid-kv-store-put", daemon=True),
            threading.Thread(target=self._lookup_loop, name="hybrid-kv-store-get", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------------ state
    def key_of(self, block_key: bytes) -> str:
        return f"{self.namespace}/{block_key.hex()}"

    def counters(self) -> StoreCounters:
        with self._lock:
            return StoreCounters(**self._counters.__dict__)

    def _count(self, **growth: int) -> None:
        with self._lock:
            for name, value in growth.items():
                setattr(self._counters, name, getattr(self._counters, name) + value)

    def available(self) -> bool:
        """The client is set up and the breaker is closed."""
        return self._client is not None and self._clock() >= self._open_until

    def trip(self, reason: str) -> None:
        """Stop using the store for ``retry_s`` (a failure or a lookup past its deadline)."""
        with self._lock:
            self._open_until = self._clock() + self.retry_s
            self._counters.breaker_trips += 1
            self.last_failure = reason
        logger.warning("hybrid-kv-plugin: Mooncake store unused for %.1f s: %s", self.retry_s, reason)

    # ------------------------------------------------------------------ puts
    def offer(self, items: list[tuple[list[tuple[str, int | None]], Callable[[], bytes]]], release: Callable[[], None]) -> bool:
        """Queue blocks for writing: per block its (key, num_tokens) list and a reader of its bytes.

        ``release`` runs on the put thread once every reader has run (the caller pins the
        blocks until then). False, and nothing queued (the caller unpins at once), where
        the store is unavailable or ``max_queued_puts`` blocks already wait.
        """
        if not self.available():
            self._count(puts_dropped=len(items))
            return False
        with self._lock:
            if self._waiting_blocks and self._waiting_blocks + len(items) > self.max_queued_puts:
                self._counters.puts_dropped += len(items)
                return False
            self._waiting_blocks += len(items)
        self._puts.put_nowait((items, release))
        return True

    def _put_loop(self) -> None:
        while not self._closed.is_set():
            try:
                items, release = self._puts.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                self._write(items, release)
            except Exception as err:  # noqa: BLE001 - a block reader or the release failed: the thread goes on
                self._count(put_failures=1)
                self.trip(f"put failed: {err!r}")
            finally:
                self._puts.task_done()

    def _write(self, items: list[tuple[list[tuple[str, int | None]], Callable[[], bytes]]], release: Callable[[], None]) -> None:
        try:
            payloads = [(keys, read()) for keys, read in items]
        finally:
            try:
                release()
            finally:
                with self._lock:
                    self._waiting_blocks -= len(items)
        for keys, payload in payloads:
            client = self._client
            if client is None or not self.available():
                self._count(puts_dropped=1)
                continue
            try:
                codes = [self._put_waiting_for_room(client, key, encode(num_tokens, payload)) for key, num_tokens in keys]
            except Exception as err:  # noqa: BLE001 - any client error is a store failure, never the engine's
                codes = [repr(err)]
                self._replace_if_gone(client)
            failed = [code for code in codes if code not in (0, STORE_FULL)]
            if failed:
                self._count(put_failures=1)
                self.trip(f"put failed: {failed[0]}")
            elif STORE_FULL in codes:
                self._count(puts_store_full=1)
            else:
                self._count(blocks_put=1, keys_put=len(keys), bytes_put=len(payload) * len(keys))

    def _put_waiting_for_room(self, client: Any, key: str, value: bytes) -> int:
        """``put``; while the store answers "full", retry every ``FULL_RETRY_S`` (the master is evicting), for
        about ``full_wait_s`` in all (counted in retries, so a stand-in clock cannot stretch it)."""
        code = client.put(key, value)
        for _ in range(max(1, round(self.full_wait_s / FULL_RETRY_S))):
            if code != STORE_FULL or self._closed.is_set():
                break
            self._count(put_full_retries=1)
            self._closed.wait(FULL_RETRY_S)
            code = client.put(key, value)
        return code

    # ------------------------------------------------------------------ lookups
    def lookup(self, keys: Iterable[str]) -> LookupJob | None:
        """Start fetching ``keys``; None (counted) where the store is unavailable."""
        if not self.available():
            self._count(lookups_skipped=1)
            return None
        job = LookupJob(keys=list(keys), started=self._clock())
        self._count(lookups=1)
        self._lookups.put(job)
        return job

    def expired(self, job: LookupJob) -> bool:
        """The job is unfinished past its deadline: abandoned and counted (ask once per job). The breaker
        opens only where the store is slow: it has owed the lookup thread its current answer for a whole
        deadline. A job that waited behind healthy lookups opens nothing, and is dropped unasked if queued."""
        now = self._clock()
        if job.done.is_set() or now - job.started < self.lookup_timeout_s:
            return False
        job.abandoned = True
        serving = self._serving_since
        if serving is None or now - serving < self.lookup_timeout_s:
            self._count(lookups_expired_queued=1)
            return True
        self._count(lookup_timeouts=1)
        self.trip(f"lookup unfinished after {self.lookup_timeout_s:.1f} s")
        return True

    def _lookup_loop(self) -> None:
        free_since = 0.0  # when the previous job finished: a job queued after that waited for nothing
        while not self._closed.is_set():
            try:
                job = self._lookups.get(timeout=0.2)
            except queue.Empty:
                continue
            if not job.abandoned:
                client = self._client
                self._serving_since = max(job.started, free_since)
                try:
                    self._fetch(client, job)
                except Exception as err:  # noqa: BLE001 - reported as a miss, never raised into the engine
                    job.error = repr(err)
                    self._replace_if_gone(client)
                self._serving_since = None
            free_since = self._clock()
            self._count(lookup_ms=round((free_since - job.started) * 1000))
            if job.error:
                self._count(lookup_errors=1)
                self.trip(f"lookup failed: {job.error}")
            job.done.set()

    def _fetch(self, client: Any, job: LookupJob) -> None:
        if client is None:
            job.error = "client not set up"
            return
        exists = client.batch_is_exist(job.keys)
        if any(flag < 0 for flag in exists):
            job.error = "batch_is_exist failed"
            return
        present = [key for key, flag in zip(job.keys, exists) if flag == 1]
        job.absent = {key for key, flag in zip(job.keys, exists) if flag != 1}
        values = client.get_batch(present) if present else []
        for key, value in zip(present, values):
            if len(value) < _HEADER.size:
                job.absent.add(key)  # evicted between the two calls, or the transfer failed
                continue
            job.found[key] = decode(bytes(value))
        self._count(
            keys_found=len(job.found),
            keys_absent=len(job.absent),
            bytes_fetched=sum(len(payload) for _, payload in job.found.values()),
        )

    # ------------------------------------------------------------------ lifetime
    def _setup_loop(self, gone: Any = None) -> None:
        if gone is not None:
            try:
                gone.close()  # reaps what is left of it
            except Exception:  # noqa: BLE001
                pass
        while not self._closed.is_set():
            try:
                client = self._connect()
            except Exception:  # noqa: BLE001 - the engine serves from its own tier meanwhile
                self._count(setup_failures=1)
                self._closed.wait(self.retry_s)
                continue
            with self._lock:  # close() sets _closed before it takes the client under this lock
                if not self._closed.is_set():
                    self._client = client
                    return
            client.close()
            return

    def _replace_if_gone(self, client: Any) -> None:
        """After a failed call: a client that reports itself gone is replaced (once per client, whichever
        thread sees it first); until the new one is set up the store is unavailable."""
        alive = getattr(client, "alive", None)
        if alive is None or alive():
            return
        with self._lock:
            if self._client is not client or self._closed.is_set():
                return
            self._client = None
            self._counters.clients_replaced += 1
        thread = threading.Thread(target=self._setup_loop, args=(client,), name="hybrid-kv-store-setup", daemon=True)
        self._threads.append(thread)
        thread.start()

    def idle(self) -> bool:
        """No put queued or being written."""
        return self._puts.unfinished_tasks == 0

    def note_installed(self, blocks: int) -> None:
        self._count(blocks_installed=blocks)

    def close(self) -> None:
        """Stop the threads (each within ~0.2 s unless inside a store call) and close the client."""
        self._closed.set()
        for thread in self._threads:
            thread.join(timeout=1.0)
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001
                pass
