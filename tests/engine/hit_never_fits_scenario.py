"""A request whose prefix hit makes it too large for the whole KV pool, on the real engine.

``run(llm)`` drives one engine: request a (49 tokens) leaves vLLM's own prompt-tail
Mamba state at 48; request b extends it to 380 tokens (+4 generated, ``max_model_len``
384) and is stepped at most ``STEP_LIMIT`` times; then, if b finished, b again under a
fresh ``cache_salt`` (uncached). Run as a script (``python hit_never_fits_scenario.py
MODEL_DIR sync|async``) it builds the engine itself (``Scheduler`` or ``AsyncScheduler``)
and prints the result as JSON:
test_hit_never_fits_engine.py runs it that way with ``HYBRID_KV_PLUGIN_DISABLE=1`` (stock).
"""

from __future__ import annotations

import dataclasses
import random
import sys
from typing import Any

MAX_MODEL_LEN = 384
# 1 attention + 3 Mamba groups (the tiny model's layers), 32-token blocks: b alone runs to the
# end from 22 blocks on 0.29 (19 on 0.32), and with a's 48-token hit it needs 23.
POOL_BLOCKS = 22
A_LENGTH, B_LENGTH = 49, 380
# No connector (with the plugin disabled its connector is not registered), and the small pool.
ENGINE_OPTIONS = {"kv_transfer_config": None, "num_gpu_blocks_override": POOL_BLOCKS}
STEP_LIMIT = 40  # b needs 6 steps (3 prefill chunks, 3 more tokens) where it is admitted at once


def prompt() -> list[int]:
    rng = random.Random("hit-never-fits")
    return [rng.randrange(3, 1024) for _ in range(B_LENGTH)]


def geometry():
    from engine_run import ENGINE_GEOMETRY

    return dataclasses.replace(ENGINE_GEOMETRY, max_model_len=MAX_MODEL_LEN)


def engine_options(scheduling: str) -> dict[str, Any]:
    """The engine's overrides for ``scheduling`` ("sync" or "async"; build it inside
    ``engine_run.async_scheduling_kept(scheduling == "async")``)."""
    return dict(ENGINE_OPTIONS, async_scheduling=scheduling == "async")


def run(llm) -> dict[str, Any]:
    from engine_run import generate_records, greedy_params, output_record, tokens_prompt

    p = prompt()
    (a,) = generate_records(llm, [p[:A_LENGTH]])
    out: dict[str, Any] = {"a": a}
    engine = llm.llm_engine
    engine.add_request("b", tokens_prompt(p), greedy_params())
    finished = None
    for step in range(1, STEP_LIMIT + 1):
        for output in engine.step():
            if output.request_id == "b" and output.finished:
                finished = output
        if finished is not None:
            break
    out["b steps"] = step
    out["b"] = output_record(finished) if finished is not None else None
    if finished is None:
        engine.abort_request(["b"])  # stock: still waiting; leave the engine idle for shutdown
    else:
        (out["b uncached"],) = generate_records(llm, [p], cache_salt="hit-never-fits-uncached")
    return out


def main(model_dir: str, scheduling: str) -> None:
    from pathlib import Path

    from engine_run import async_scheduling_kept, report_to_parent

    with async_scheduling_kept(scheduling == "async"):
        report_to_parent(Path(model_dir), geometry(), run, "HIT_NEVER_FITS_RESULT", **engine_options(scheduling))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
