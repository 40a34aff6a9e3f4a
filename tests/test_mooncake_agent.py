"""The store agent's pipe (mooncake_store/agent.py) with a stand-in agent process: the same pipe
protocol as the real agent, no Mooncake client. An agent that never answers a call is killed after
``call_timeout_s``, and the store tier then replaces it: a hung store call costs one failed put, not
the put thread and every block queued behind it."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from hybrid_kv_plugin.mooncake_store.agent import AgentClient
from hybrid_kv_plugin.mooncake_store.tier import StoreTier

# Answers setup and every call with 0, except a put of the key "hang", which it never answers.
STAND_IN_AGENT = """
import sys, time
from hybrid_kv_plugin.mooncake_store.agent import _receive, _send
while True:
    try:
        op, args = _receive(sys.stdin.buffer)
    except EOFError:
        break
    if op == "close":
        break
    if op == "put" and args[0] == "hang":
        time.sleep(3600)
    _send(sys.stdout.buffer, (True, 0))
"""


def _client(timeout_s: float) -> AgentClient:
    return AgentClient(("setup",), call_timeout_s=timeout_s, command=[sys.executable, "-c", STAND_IN_AGENT])


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] == "Z"  # reaped below by wait(); a zombie is gone too
    except FileNotFoundError:
        return True


def test_a_call_the_agent_never_answers_kills_it():
    client = _client(0.5)
    try:
        assert client.put("k", b"v") == 0
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"^store agent did not answer put within 0\.5 s: killed$"):
            client.put("hang", b"v")
        assert 0.5 <= time.monotonic() - started < 5
        assert not client.alive() and client.proc.returncode == -9
    finally:
        client.close()
    assert _gone(client.pid)


def test_the_tier_replaces_an_agent_that_hung():
    """Two batches queued; the first one's put hangs. After the timeout it is one failed put (the
    breaker opens), the agent is replaced, and the second batch is written through the new one."""
    made: list[AgentClient] = []

    def connect() -> AgentClient:
        made.append(_client(0.5))
        return made[-1]

    tier = StoreTier(connect, "ns", lookup_timeout_s=1.0, retry_s=0.0, max_queued_puts=8)
    released = [threading.Event(), threading.Event()]
    try:
        deadline = time.monotonic() + 10
        while tier._client is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tier._client is made[0]
        # Keys are the tier's own: a batch is [(keys, read)]; "hang" is the stand-in's key that never answers.
        assert tier.offer([([("hang", 16)], lambda: b"a")], released[0].set)

        def read_once_replaced() -> bytes:  # the put thread reads a batch's bytes before it picks a client
            while (len(made) < 2 or tier._client is not made[1]) and time.monotonic() < deadline:
                time.sleep(0.01)
            return b"b"

        assert tier.offer([([("ns/02", 16)], read_once_replaced)], released[1].set)
        while not tier.idle() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tier.idle() and all(e.is_set() for e in released)
        counters = tier.counters()
        assert (counters.put_failures, counters.breaker_trips, counters.clients_replaced) == (1, 1, 1)
        assert (counters.blocks_put, counters.puts_dropped) == (1, 0)  # the second batch, through the new agent
        assert not made[0].alive() and made[0].proc.returncode == -9
    finally:
        tier.close()
    assert all(_gone(client.pid) for client in made)
