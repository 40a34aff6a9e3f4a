"""Two requests admitted in one step whose copy-on-write copies chain, on the real engine.

``run(llm)`` drives one engine through the scenario and returns what each request
produced plus the copies the worker ran in the step that admitted both. Run as a
script (``python same_step_scenario.py MODEL_DIR``) it builds the engine itself and
prints the same as JSON: test_same_step_copies.py runs it that way with
``HYBRID_KV_PLUGIN_DISABLE=1``, so the engine is stock vLLM (the plugin is registered
once per process, it cannot be switched off next to an engine that has it).
"""

from __future__ import annotations

import random
import sys
from typing import Any

# P caches its prompt-tail state at 80 (the last unit boundary <= N-1), keying
# attention block 64..96 there as a partial block. A and B share P's first 80 tokens
# plus 16 more (so a full block 64..96), then differ.
P_LENGTH, SHARED, TAIL = 90, 80 + 16, 44


def prompts() -> dict[str, list[int]]:
    rng = random.Random("same-step")
    p = [rng.randrange(3, 1024) for _ in range(P_LENGTH)]
    common = p[:80] + [rng.randrange(3, 1024) for _ in range(SHARED - 80)]
    a = common + [rng.randrange(3, 1024) for _ in range(TAIL)]
    b = common + [rng.randrange(3, 1024) for _ in range(TAIL)]
    return {"P": p, "A": a, "B": b}


def run(llm) -> dict[str, Any]:
    """P; then A and B in one generate call; then B's references: after P under a new salt, and uncached."""
    import vllm.v1.worker.gpu_model_runner as runner_module

    from engine_run import generate_records

    copies: list[list[list[int]]] = []
    worker_copy = runner_module.copy_kv_cache_blocks_inplace

    def recording_copy(kv_caches, num_blocks, block_copies):
        copies.append([list(copy) for copy in block_copies])
        return worker_copy(kv_caches, num_blocks, block_copies)

    runner_module.copy_kv_cache_blocks_inplace = recording_copy
    try:
        p = prompts()
        out: dict[str, Any] = {}
        (out["P"],) = generate_records(llm, [p["P"]])
        del copies[:]
        out["A"], out["B"] = generate_records(llm, [p["A"], p["B"]])
        out["copies"] = list(copies)
        # The same B hit with no chain: P cached under another salt, then B alone.
        generate_records(llm, [p["P"]], cache_salt="same-step-reference")
        (out["B reference"],) = generate_records(llm, [p["B"]], cache_salt="same-step-reference")
        (out["B uncached"],) = generate_records(llm, [p["B"]], cache_salt="same-step-uncached")
        (out["A uncached"],) = generate_records(llm, [p["A"]], cache_salt="same-step-uncached-a")
        return out
    finally:
        runner_module.copy_kv_cache_blocks_inplace = worker_copy


def main(model_dir: str) -> None:
    from pathlib import Path

    from engine_run import ENGINE_GEOMETRY, report_to_parent

    # No connector: with the plugin disabled its connector is not registered.
    report_to_parent(Path(model_dir), ENGINE_GEOMETRY, run, "SAME_STEP_RESULT", kv_transfer_config=None)


if __name__ == "__main__":
    main(sys.argv[1])
