"""Cold -> replay with the real scheduler: what each ``prompt_tail_checkpoint`` value buys and costs.

One engine per measurement (the installed wheel's Scheduler, KV-cache manager and
the plugin's connector, stepped by :class:`~hybrid_kv_plugin.sim.SimEngine`):
request A runs, the GPU prefix cache is evicted, then request C - A's prompt again
(an exact replay) or A's prompt plus three new tokens (a continuation) - runs; C's
hit can only come from the CPU tier. Offload invariants are checked at the end.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybrid_kv_plugin.connector_names import CONNECTOR_NAME
from hybrid_kv_plugin.sim import HybridGeometry, SimEngine
from hybrid_kv_plugin.sim.invariants import OffloadInvariants
from scenarios.offload import CONTINUATION, CPU_BYTES, OffloadRun

EXACT, CONTINUED = "exact", "continuation"


@dataclass(frozen=True)
class ReplayMeasurement:
    """``hit``: C's CPU-tier hit in tokens. ``prefill_steps``: steps A needed until its
    prompt was computed. ``mamba_states``: Mamba blocks with a prefix-cache key on the GPU
    once A finished. ``mamba_stored``: Mamba boundary states the connector stored for A."""

    hit: int
    prefill_steps: int
    mamba_states: int
    mamba_stored: int


def tail_engine(adapter: Any, mode: str, geometry: HybridGeometry | None = None) -> OffloadRun:
    engine = SimEngine(
        geometry or HybridGeometry(),
        adapter=adapter,
        kv_connector=CONNECTOR_NAME,
        kv_connector_extra_config={"cpu_bytes_to_use": CPU_BYTES},
        additional_config={"hybrid_kv": {"prompt_tail_checkpoint": mode}},
    )
    return OffloadRun(engine, OffloadInvariants(engine), itertools.count())


def cold_replay(
    adapter: Any, mode: str, prompt: Sequence[int], kind: str, geometry: HybridGeometry | None = None,
    max_tokens: int = 4,
) -> ReplayMeasurement:
    run = tail_engine(adapter, mode, geometry)
    engine = run.engine
    run.request(prompt, max_tokens=max_tokens)
    prefill_steps = sum(1 for step in engine.steps if step.num_scheduled_tokens) - (max_tokens - 1)
    states = mamba_states_held(engine)
    stored = engine.connector.get_boundary_store_stats().stored
    assert engine.reset_prefix_cache(), "the GPU prefix cache must be resettable once idle"
    replay = list(prompt) if kind == EXACT else [*prompt, *CONTINUATION]
    hit = run.request(replay)
    run.invariants.check()
    return ReplayMeasurement(hit, prefill_steps, states, stored)


def mamba_states_held(engine: SimEngine) -> int:
    """GPU blocks of the Mamba group that carry a prefix-cache key (one per reusable state)."""
    from vllm.v1.core.kv_cache_utils import get_group_id

    mamba_groups = {
        index for index, group in enumerate(engine.kv_cache_config.kv_cache_groups)
        if getattr(group.kv_cache_spec, "mamba_cache_mode", None) is not None
    }
    return sum(
        1 for block in engine.gpu_block_pool.blocks
        if block.block_hash is not None and get_group_id(block.block_hash) in mamba_groups
    )


def gpu_replay(
    adapter: Any, mode: str, prompt: Sequence[int], kind: str, geometry: HybridGeometry | None = None,
    max_tokens: int = 4,
) -> tuple[int, int]:
    """Request A, then C with A's blocks still on the GPU: C's (hit, CPU-tier part of it)."""
    run = tail_engine(adapter, mode, geometry)
    run.request(prompt, max_tokens=max_tokens)
    replay = list(prompt) if kind == EXACT else [*prompt, *CONTINUATION]
    req_id = "gpu-replay"
    hit = run.engine.run([(req_id, replay)], max_tokens=1)[req_id]
    run.invariants.check()
    return hit, run.external_tokens(req_id)
