"""A request preempted by a GPU-cache reset, and the siblings that diverge inside its prefix, on the real engine.

``run(llm)`` drives one engine (``mamba_divergence_checkpoint`` on, no connector): the same
requests twice, under two ``cache_salt`` values, first with r0 never preempted ("kept"), then
with r0 preempted by ``LLM.reset_prefix_cache(reset_running_requests=True)`` once its prompt
is computed ("preempted"; the reset drops the whole GPU prefix cache, so it goes second).
Run as a script (``python preemption_keys_scenario.py MODEL_DIR``) it builds that engine in
its own process and prints the result as JSON: test_preemption_keys_engine.py runs it that way,
since an engine without a connector must not inherit the connector state an earlier engine
of the test process left behind.
"""

from __future__ import annotations

import random
import sys
from typing import Any

SHARED, OWN, ANSWER, SUFFIX = 1208, 150, 60, 100
ON = {"hybrid_kv": {"mamba_divergence_checkpoint": True}}
MARKER = "PREEMPTION_KEYS_RESULT"


def tokens(seed: str, n: int) -> list[int]:
    """Random ids clear of the special 0-2, distinct per seed."""
    rng = random.Random(f"preemption-{seed}")
    return [rng.randrange(3, 1024) for _ in range(n)]


def run_r0(llm, salt: str, preempt: bool) -> list[int]:
    """r0 stepped by hand; with ``preempt``, preempted once its prompt is computed. [its preemptions, its answer tokens]."""
    from engine_run import greedy_params, tokens_prompt

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    prompt = tokens("prefix", SHARED) + tokens("own", OWN)
    engine.add_request(f"r0-{salt}", tokens_prompt(prompt, salt), greedy_params(ANSWER))
    (request,) = scheduler.requests.values()
    if preempt:
        while request.num_computed_tokens < len(prompt):
            engine.step()
        assert llm.reset_prefix_cache(reset_running_requests=True)
    answer = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                answer = len(output.outputs[0].token_ids)
    return [request.num_preemptions, answer]


def siblings(llm, salt: str, preempt: bool) -> dict[str, Any]:
    from engine_run import generate

    r0 = run_r0(llm, salt, preempt)
    runs = {k: generate(llm, tokens("prefix", SHARED) + tokens(f"suffix-{k}", SUFFIX), cache_salt=salt) for k in (1, 2)}
    r2 = runs[2]
    return {"r0": r0, "hits": [runs[1].num_cached_tokens, r2.num_cached_tokens],
            "r2": {"token_ids": list(r2.token_ids), "logprobs": list(r2.logprobs)}}  # fmt: skip


def run(llm) -> dict[str, Any]:
    return {"kept": siblings(llm, "kept", preempt=False), "preempted": siblings(llm, "preempted", preempt=True)}


def main(model_dir: str) -> None:
    from pathlib import Path

    from engine_run import ENGINE_GEOMETRY, report_to_parent

    report_to_parent(Path(model_dir), ENGINE_GEOMETRY, run, MARKER, kv_transfer_config=None, additional_config=ON)


if __name__ == "__main__":
    main(sys.argv[1])
