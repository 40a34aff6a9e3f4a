"""vLLM's prompt-tail Mamba state under AsyncScheduler, on the real engine (patch ``prompt_tail_keyed_once``).

``run(llm)`` drives one engine built with ``async_scheduling`` (no connector, a 24-block
pool, 32-token blocks, 16-token unit): request a (48 tokens: three units, inside the
second Mamba block) leaves vLLM's prompt-tail state at 48 (0.29-0.31); under
``AsyncScheduler`` stock vLLM keys a second copy of it after a's first decode wrote the
state after 49 tokens into the block. A 256-token filler then takes the free blocks up
to and including the right copies (one per Mamba layer), which were freed first; b (a's
prompt plus 40 tokens) hits 48. Then b once more under a fresh ``cache_salt``, from
token 0 in b's chunks (``engine_run.cut_at_hit`` at ``cut``: b's hit, or where b's first
chunk ended when it hit nothing - bf16 kernels round by chunk): the reference. Run as a
script (``python prompt_tail_keyed_once_scenario.py MODEL_DIR CUT``) it builds the engine
itself and prints the result as JSON (stock: ``HYBRID_KV_PLUGIN_DISABLE=1``).
"""

from __future__ import annotations

import dataclasses
import random
import sys
from typing import Any

A_LENGTH, B_LENGTH, FILLER_LENGTH = 48, 88, 256
POOL_BLOCKS = 24
MAX_MODEL_LEN = 512
ENGINE_OPTIONS = {"kv_transfer_config": None, "num_gpu_blocks_override": POOL_BLOCKS, "async_scheduling": True}
MARKER = "PROMPT_TAIL_KEYED_ONCE_RESULT"


def prompt() -> list[int]:
    rng = random.Random("prompt-tail-keyed-once")
    return [rng.randrange(3, 1024) for _ in range(B_LENGTH)]


def filler() -> list[int]:
    rng = random.Random("filler")
    return [rng.randrange(3, 1024) for _ in range(FILLER_LENGTH)]


def geometry():
    from engine_run import ENGINE_GEOMETRY

    return dataclasses.replace(ENGINE_GEOMETRY, max_model_len=MAX_MODEL_LEN)


def run(llm, cut: int) -> dict[str, Any]:
    from engine_run import cut_at_hit, generate_records

    p = prompt()
    out: dict[str, Any] = {}
    (out["a"],) = generate_records(llm, [p[:A_LENGTH]])
    (out["filler"],) = generate_records(llm, [filler()])
    (out["b"],) = generate_records(llm, [p])
    reference = cut_at_hit(llm, p, cut, "prompt-tail-keyed-once-reference")
    out["reference"] = {"num_cached_tokens": reference.num_cached_tokens, "token_ids": list(reference.token_ids),
                        "logprobs": list(reference.logprobs)}  # fmt: skip
    return out


def main(model_dir: str, cut: str) -> None:
    from pathlib import Path

    from engine_run import async_scheduling_kept, report_to_parent

    with async_scheduling_kept():
        report_to_parent(Path(model_dir), geometry(), lambda llm: run(llm, int(cut)), MARKER, **ENGINE_OPTIONS)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
