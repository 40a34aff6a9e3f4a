"""One engine of the Mooncake cluster test, in a process of its own, driven over stdin/stdout.

``python mooncake_engine.py MODEL_DIR STORE_OPTIONS_JSON ADDITIONAL_CONFIG_JSON`` builds an in-process engine with
``HybridMooncakeStoreConnector`` and prints ``READY``; then per JSON line on stdin it answers
one ``RESULT <json>`` line:

- ``{"op": "generate", "prompt": [...], "max_tokens": N, "salt": S|null}``: the completion
  (tokens, logprobs, hits) and the longest scheduler step it took (seconds);
- ``{"op": "flush", "filler": [...], "salt": S}``: one more step, then the store writes finish;
- ``{"op": "reference", "producer", "consumer", "hit", "salt"}``: ``engine_run.like_for_like``;
- ``{"op": "reset"}``: GPU prefix cache and local CPU tier emptied (the store keeps its keys);
- ``{"op": "counters"}``: the store tier's counters and the CPU tier's outcome counters;
- ``{"op": "exit"}``: shuts the engine down (closing the store client) and exits.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from engine_run import ENGINE_GEOMETRY, build_llm, engine_environment, generate, like_for_like  # noqa: E402

from hybrid_kv_plugin.connector_names import STORE_CONNECTOR_NAME  # noqa: E402

engine_environment()  # the same knobs as the pytest process's engines (conftest.py), before vLLM is imported


def _timed_steps(core) -> list[float]:
    """Wrap the engine core's step so each one's duration is recorded (this process only)."""
    durations: list[float] = []
    inner = core.step_fn  # what the in-process client calls once per engine step

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            durations.append(time.perf_counter() - t0)

    core.step_fn = timed
    return durations


def _timed_connector_calls(connector) -> list[float]:
    """Durations of the connector's scheduler-side calls that consult the store tier (this process only)."""
    durations: list[float] = []
    for name in ("get_num_new_matched_tokens", "build_connector_meta"):
        inner = getattr(connector, name)

        def timed(*args, _inner=inner, **kwargs):
            t0 = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                durations.append(time.perf_counter() - t0)

        setattr(connector, name, timed)
    return durations


def main(model_dir: str, store_options: str, additional_config: str) -> None:
    llm = build_llm(
        Path(model_dir),
        ENGINE_GEOMETRY,
        additional_config=json.loads(additional_config),
        kv_transfer_config={
            "kv_connector": STORE_CONNECTOR_NAME,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "cpu_bytes_to_use": ENGINE_GEOMETRY.cpu_bytes_to_use,
                "mooncake_store": json.loads(store_options),
            },
        },
    )
    core = llm.llm_engine.engine_core.engine_core
    connector = core.scheduler.connector
    steps = _timed_steps(core)
    calls = _timed_connector_calls(connector)
    # The store client sets up on a thread of its own: wait for it (bounded) before serving.
    deadline = time.monotonic() + 60
    while not connector.store_tier.available() and time.monotonic() < deadline:
        time.sleep(0.05)
    agent = getattr(connector.store_tier._client, "pid", None)
    print("READY " + json.dumps({"store": connector.store_tier.available(), "pid": os.getpid(), "agent": agent}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "generate":
            steps.clear()
            calls.clear()
            done = generate(llm, command["prompt"], cache_salt=command.get("salt"), max_tokens=command["max_tokens"])
            result = asdict(done) | {
                "longest_step_s": max(steps, default=0.0), "steps": len(steps),
                "longest_connector_call_s": max(calls, default=0.0),
            }
        elif op == "flush":
            # One more step, so the stores queued when the last request finished complete, then
            # wait (bounded) until the put thread wrote them; salted away from every prompt.
            generate(llm, command["filler"], cache_salt=command["salt"], max_tokens=1)
            deadline = time.monotonic() + 30
            while not connector.store_tier.idle() and time.monotonic() < deadline:
                time.sleep(0.02)
            result = {"idle": connector.store_tier.idle()}
        elif op == "reference":
            done = like_for_like(llm, command["producer"], command["consumer"], command["hit"], command["salt"])
            result = asdict(done)
        elif op == "reset":
            result = {"reset": bool(llm.reset_prefix_cache())}
        elif op == "counters":
            result = {
                "store": asdict(connector.store_counters()),
                "outcomes": connector.get_boundary_store_stats().as_dict(),
                "available": connector.store_tier.available(),
                "last_failure": connector.store_tier.last_failure,
                "agent": getattr(connector.store_tier._client, "pid", None),  # None while a new one sets up
            }
        elif op == "exit":
            llm.llm_engine.engine_core.shutdown()
            print("RESULT " + json.dumps({"exited": True}), flush=True)
            return
        else:
            result = {"error": f"unknown op {op}"}
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
