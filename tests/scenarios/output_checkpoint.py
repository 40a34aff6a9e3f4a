"""Two conversation turns with the real scheduler: what ``mamba_output_checkpoint`` buys and costs.

Turn A runs (prompt, then ``output`` decoded tokens); optionally the GPU prefix
cache is evicted; turn B = A's prompt + A's answer + new tokens runs. B's hit then
comes from the CPU tier (HybridSimpleCPUConnector) or from the GPU prefix cache.
Offload invariants are checked at the end.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybrid_kv_plugin.connector_names import CONNECTOR_NAME
from hybrid_kv_plugin.sim import HybridGeometry, SimEngine
from hybrid_kv_plugin.sim.engine import SAMPLED_TOKEN
from hybrid_kv_plugin.sim.invariants import OffloadInvariants
from scenarios.offload import CPU_BYTES, OffloadRun

# New text of turn B (never cached anywhere).
NEW_TURN = tuple(range(500, 520))


@dataclass(frozen=True)
class TurnMeasurement:
    """``hit``: B's hit in tokens; ``external``: the part the CPU tier loaded.
    ``steps``: scheduler steps A needed. ``max_answer_states``: the most Mamba blocks
    keyed inside A's answer (between Mamba block ends) at any step while A ran.
    ``answer_states_left``: those left in the GPU prefix cache once A finished.
    ``mamba_stored``: Mamba states the connector stored for A. ``forward_steps``: those of
    A's steps that scheduled tokens (the rest only drain the connector's stores)."""

    hit: int
    external: int
    steps: int
    max_answer_states: int
    answer_states_left: int
    mamba_stored: int
    forward_steps: int


def turn_engine(adapter: Any, enabled: bool | None, geometry: HybridGeometry | None = None,
                connector: bool = True) -> OffloadRun:
    """``enabled`` None: the option not given at all."""
    section = {} if enabled is None else {"mamba_output_checkpoint": enabled}
    kwargs: dict[str, Any] = {}
    if connector:
        kwargs = {"kv_connector": CONNECTOR_NAME, "kv_connector_extra_config": {"cpu_bytes_to_use": CPU_BYTES}}
    engine = SimEngine(geometry or HybridGeometry(), adapter=adapter, additional_config={"hybrid_kv": section},
                       **kwargs)
    return OffloadRun(engine, OffloadInvariants(engine) if connector else None, itertools.count())


def queued_finish_store_blocks(manager: Any) -> list[int]:
    """GPU block ids of the stores queued at finish, not sent yet (the 0.26-0.29 backport's queue or the wheel's)."""
    queued = getattr(manager, "_finish_batches", None)
    if queued is None:
        queued = manager._pending_finished_stores
    return [block_id for store in queued for block_id in store.gpu_block_ids]


def answer_states(engine: SimEngine, prompt_tokens: int) -> int:
    """Mamba blocks whose prefix-cache key ends inside an answer, between Mamba block ends."""
    from vllm.v1.core.kv_cache_utils import get_group_id

    sizes = {
        index: group.kv_cache_spec.block_size
        for index, group in enumerate(engine.kv_cache_config.kv_cache_groups)
        if getattr(group.kv_cache_spec, "mamba_cache_mode", None) is not None
    }
    count = 0
    for block in engine.gpu_block_pool.blocks:
        if block.block_hash is None or get_group_id(block.block_hash) not in sizes:
            continue
        position = block.block_hash_num_tokens
        if position is not None and position > prompt_tokens and position % sizes[get_group_id(block.block_hash)]:
            count += 1
    return count


def two_turns(adapter: Any, enabled: bool | None, prompt: Sequence[int], output: int, *, reset_gpu: bool,
              geometry: HybridGeometry | None = None, connector: bool = True) -> TurnMeasurement:
    run = turn_engine(adapter, enabled, geometry, connector)
    engine = run.engine
    engine.add_request("a", prompt, max_tokens=output)
    peak = 0
    while engine.has_work():
        engine.step()
        peak = max(peak, answer_states(engine, len(prompt)))
    steps = len(engine.steps)
    left = answer_states(engine, len(prompt))
    stored = engine.connector.get_boundary_store_stats().stored if connector else 0
    if reset_gpu:
        assert engine.reset_prefix_cache(), "the GPU prefix cache must be resettable once idle"
    # The simulated model samples the same token every step.
    turn_b = [*prompt, *([SAMPLED_TOKEN] * output), *NEW_TURN]
    hit = run.request(turn_b)
    external = run.external_tokens("r0")
    if run.invariants is not None:
        run.invariants.check()
    forward = sum(1 for record in engine.steps[:steps] if record.num_scheduled_tokens)
    return TurnMeasurement(hit, external, steps, peak, left, stored, forward)


def keys_compared_by_value(pool: Any, block: Any, primary: Any, secondary: Any) -> bool:
    """An ablation of ``attention_partial_block.carries_key_objects`` (the plugin's check, not vLLM
    code): equal keys pass, so a block handed on and keyed again looks unchanged."""
    now = pool.cached_block_hashes_by_block.get(block.block_id, ())
    return block.block_hash == primary and set(now) == set(secondary)
