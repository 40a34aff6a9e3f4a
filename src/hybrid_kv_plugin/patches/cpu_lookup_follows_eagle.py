"""Patch ``SimpleCPUOffloadScheduler.__init__`` and its module's ``get_kv_cache_coordinator``: the CPU tier's
prefix lookup drops EAGLE's last block, as the GPU prefix cache does.

Why: EAGLE drops the last block of every prefix hit: the drafter needs the target's
hidden state at the hit's end, which only recomputing that block gives it (its draft
KV there was written before the next token was known). vLLM 0.26 builds the SimpleCPU
connector's CPU-side coordinator with ``use_eagle=False`` whatever the engine runs, so
a prefix served from the CPU tier keeps that block: the drafter resumes without the
hidden state it needs, and the same prefix hits one block deeper from the CPU tier
than from the GPU prefix cache (``tests/test_cpu_lookup_follows_eagle.py``: 320
against 192 tokens). Found while the byte-checked soak ran with EAGLE on (0.26.0).

What it changes: while the SimpleCPU scheduler side is constructed, the
coordinator factory it calls gets ``use_eagle`` from the engine's speculative config
(an EAGLE-family method), so the CPU lookup drops the last block exactly as the GPU
lookup does; nothing else of the constructor changes. Without speculative decoding
the factory gets what vLLM passes.

Upstream: vLLM PR #49071 ("Propagate EAGLE mode to SimpleCPU coordinator"), in
0.27.0; adapter fact ``simplecpu_lookup_ignores_eagle``. Installed on 0.26.x; removed
in 0.27.0.
"""

from __future__ import annotations

import contextvars
import functools
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.patching import Fingerprint, Installs, PatchSpec

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

MODULE = "vllm.v1.simple_kv_offload.manager"
CONSTRUCTOR = f"{MODULE}:SimpleCPUOffloadScheduler.__init__"
FACTORY = f"{MODULE}:get_kv_cache_coordinator"
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "vllm_fix"
INSTALLS = Installs(when=lambda adapter: adapter.simplecpu_lookup_ignores_eagle, since="0.26.0", removed_in="0.27.0")

FACTORY_PARAMS = ("kv_cache_config", "max_model_len", "max_in_flight_tokens", "use_eagle")
USE_EAGLE_POSITION = FACTORY_PARAMS.index("use_eagle")
# True while a SimpleCPU scheduler side of an EAGLE engine is being constructed.
_ENGINE_RUNS_EAGLE: contextvars.ContextVar[bool] = contextvars.ContextVar("hybrid_kv_engine_runs_eagle", default=False)


def specs(adapter: VllmAdapter) -> list[PatchSpec]:
    """The factory the constructor calls, and the constructor that says whether the engine runs EAGLE."""
    common = dict(
        why="the SimpleCPU tier's lookup keeps EAGLE's volatile last block, whose Mamba state a chunk end left behind",
        upstream="vLLM PR #49071 (0.27.0)",
    )
    return [
        PatchSpec(
            name="cpu_lookup_follows_eagle.factory",
            target=FACTORY,
            fingerprint=Fingerprint(params=FACTORY_PARAMS),
            build=_wrap_factory,
            **common,
        ),
        PatchSpec(
            name="cpu_lookup_follows_eagle.constructor",
            target=CONSTRUCTOR,
            fingerprint=Fingerprint(params=("self", "vllm_config")),
            build=_wrap_constructor,
            **common,
        ),
    ]


def engine_runs_eagle(vllm_config: Any) -> bool:
    """Whether the engine drafts with an EAGLE-family method (EAGLE, EAGLE3, MTP, ...)."""
    speculative = getattr(vllm_config, "speculative_config", None)
    return speculative is not None and bool(speculative.use_eagle())


def _wrap_factory(original: Any) -> Any:
    @functools.wraps(original)
    def get_kv_cache_coordinator(*args: Any, **kwargs: Any) -> Any:
        # Only the SimpleCPU constructor below sets the flag; vLLM passes keywords, a positional call is served too.
        if _ENGINE_RUNS_EAGLE.get():
            if len(args) > USE_EAGLE_POSITION:
                args = (*args[:USE_EAGLE_POSITION], True, *args[USE_EAGLE_POSITION + 1 :])
            else:
                kwargs["use_eagle"] = True
        return original(*args, **kwargs)

    return get_kv_cache_coordinator


def _wrap_constructor(original: Any) -> Any:
    @functools.wraps(original)
    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        token = _ENGINE_RUNS_EAGLE.set(engine_runs_eagle(vllm_config))
        try:
            original(self, vllm_config, *args, **kwargs)
        finally:
            _ENGINE_RUNS_EAGLE.reset(token)

    return __init__
