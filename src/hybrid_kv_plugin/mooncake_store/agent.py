"""The Mooncake store client in a process of its own, so nothing it does can stall the engine's interpreter.

Measured here: while the master is down, ``put`` blocks ~4.4 s and holds the caller's GIL
for up to 1.7 s of it, so a client in the engine process stalls engine steps even from a
background thread. :class:`AgentClient` has the four calls :class:`~.tier.StoreTier` makes;
each is a request over a pipe to ``python -m hybrid_kv_plugin.mooncake_store.agent``,
whose reply the calling (tier) thread waits for without holding the GIL.

Puts prefer this engine's own segment (``ReplicateConfig.preferred_segment``, the client's
hostname:port). Measured (0.3.13.post1, the master's default ``random`` allocation): without
it about half of what one engine put lived in the other engine's segment, so an engine that
stopped took part of every other engine's prefixes with it. With it, an engine's blocks stay
where they were written until its segment is full; then they spill to the others.

Invariants: one request at a time per agent (a lock); the agent exits when its stdin
closes (the engine process died) or on ``close``; :meth:`AgentClient.close` ends it by its
PID if it does not exit within 5 s; an agent that has not begun to answer a call within
``call_timeout_s`` (default :data:`CALL_TIMEOUT_S`) is killed and the call raises, so a hung
store call costs the tier one failed call and a new agent (``alive()`` is False from then on),
not a thread blocked for good with its queued blocks pinned. Messages are pickled tuples with
an 8-byte length.
"""

from __future__ import annotations

import os
import pickle
import select
import struct
import subprocess
import sys
import threading
from typing import Any, BinaryIO

_LENGTH = struct.Struct("<Q")
# Far above any healthy call (a put with the master down returns after ~4.4 s, measured).
CALL_TIMEOUT_S = 60.0


def _send(stream: BinaryIO, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def _receive(stream: BinaryIO) -> Any:
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        raise EOFError("store agent closed its pipe")
    (size,) = _LENGTH.unpack(header)
    return pickle.loads(stream.read(size))


class AgentClient:
    """``setup`` runs in the agent at start; an agent that fails to set up raises here."""

    def __init__(
        self,
        setup_args: tuple[Any, ...],
        call_timeout_s: float = CALL_TIMEOUT_S,
        command: list[str] | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self.call_timeout_s = call_timeout_s
        self.proc = subprocess.Popen(
            command or [sys.executable, "-m", "hybrid_kv_plugin.mooncake_store.agent"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None,
        )  # fmt: skip
        self.pid = self.proc.pid
        rc = self._call("setup", *setup_args)
        if rc != 0:
            self.close()
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")

    def _call(self, op: str, *args: Any) -> Any:
        with self._lock:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            _send(self.proc.stdin, (op, args))
            # Between calls nothing is buffered (one reply per request), so the pipe itself tells
            # whether the reply has begun.
            ready, _, _ = select.select([self.proc.stdout], [], [], self.call_timeout_s)
            if not ready:
                self.proc.kill()
                self.proc.wait()
                raise TimeoutError(f"store agent did not answer {op} within {self.call_timeout_s:g} s: killed")
            ok, value = _receive(self.proc.stdout)
        if not ok:
            raise RuntimeError(value)
        return value

    def put(self, key: str, value: bytes) -> int:
        return self._call("put", key, value)

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return self._call("batch_is_exist", keys)

    def get_batch(self, keys: list[str]) -> list[bytes]:
        return self._call("get_batch", keys)

    def alive(self) -> bool:
        """False once the agent process has exited: it will never answer again."""
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                if self._lock.acquire(timeout=5):
                    try:
                        assert self.proc.stdin is not None
                        _send(self.proc.stdin, ("close", ()))
                        self.proc.stdin.close()
                    finally:
                        self._lock.release()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None and not stream.closed:
                stream.close()


def main() -> None:
    # The pipe is ours alone: anything the client library prints goes to stderr.
    channel_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    channel_in = sys.stdin.buffer
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    client = MooncakeDistributedStore()
    own_segment = None  # built once setup succeeded: the segment is named after the client's endpoint
    while True:
        try:
            op, args = _receive(channel_in)
        except EOFError:
            break
        if op == "close":
            break
        try:
            if op == "put":
                if own_segment is None:
                    own_segment = ReplicateConfig()
                    own_segment.preferred_segment = client.get_hostname()
                value = client.put(*args, own_segment)
            else:
                value = getattr(client, op)(*args)
            if op == "get_batch":
                value = [bytes(v) for v in value]
            reply = (True, value)
        except Exception as err:  # noqa: BLE001 - reported to the tier, which counts it
            reply = (False, repr(err))
        _send(channel_out, reply)
    client.close()


if __name__ == "__main__":
    main()
