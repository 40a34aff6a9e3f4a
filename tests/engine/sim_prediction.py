"""What the CPU simulator (``hybrid_kv_plugin.sim``) predicts for the engine test's request sequence.

Same geometry as the engine (attention block 32, Mamba block 32 ``align``, prefix-match
unit 16), same connector and plugin, vLLM's real scheduler; only the model forward and
the copies are simulated. The engine test holds the simulator to the engine's numbers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from engine_run import MAX_TOKENS, EngineGeometry

from hybrid_kv_plugin import CONNECTOR_NAME
from hybrid_kv_plugin.sim import HybridGeometry, SimEngine


@dataclass(frozen=True)
class PredictedHit:
    hit: int  # tokens not computed
    external: int  # of which loaded from the CPU tier


def predict(
    geometry: EngineGeometry, sequence: list[tuple[str, list[int]]], additional_config: dict | None = None,
    async_scheduling: bool = False,
) -> list[PredictedHit]:
    """``sequence``: ``("run", prompt)`` or ``("reset", [])`` steps, in the engine test's order;
    ``additional_config``: the engine's plugin options (``{"hybrid_kv": {...}}``); ``async_scheduling``:
    the engine core's scheduler (``AsyncScheduler`` and its batch queue when True)."""
    engine = SimEngine(
        HybridGeometry(
            attention_block_size=geometry.attention_block_size,
            mamba_block_size=geometry.mamba_block_size,
            hash_block_size=geometry.prefix_match_unit,
            num_gpu_blocks=4096,
            max_model_len=geometry.max_model_len,
            # vLLM's default, which the engine runs: only replay boundaries keep a full block's
            # Mamba state (the simulator's KVCacheConfig would otherwise keep every one).
            prefix_cache_retention_interval=0,
        ),
        kv_connector=CONNECTOR_NAME,
        kv_connector_extra_config={"cpu_bytes_to_use": geometry.cpu_bytes_to_use},
        additional_config=additional_config,
        async_scheduling=async_scheduling,
    )
    hits: list[PredictedHit] = []
    for i, (action, prompt) in enumerate(sequence):
        if action == "reset":
            assert engine.reset_prefix_cache()
            continue
        request_id = f"sim-{i}"
        hit = engine.run([(request_id, prompt)], max_tokens=MAX_TOKENS)[request_id]
        hits.append(PredictedHit(hit=hit, external=engine.outcomes[request_id].external_tokens))
    return hits


@contextlib.contextmanager
def small_pool_engine(
    geometry: EngineGeometry, num_gpu_blocks: int, *, async_scheduling: bool, plugin: bool = True
) -> Iterator[SimEngine]:
    """The engine's geometry on a ``num_gpu_blocks`` pool with no connector (the tiny model's three
    Mamba layers as three groups), under ``async_scheduling``'s engine core. The plugin is registered
    in this process, as the engine tests have it; ``plugin=False`` (stock vLLM) uninstalls it for the
    prediction and registers it again."""
    import hybrid_kv_plugin

    if not plugin:
        hybrid_kv_plugin.uninstall()
    try:
        yield SimEngine(
            HybridGeometry(
                attention_block_size=geometry.attention_block_size,
                mamba_block_size=geometry.mamba_block_size,
                hash_block_size=geometry.prefix_match_unit,
                num_gpu_blocks=num_gpu_blocks,
                max_model_len=geometry.max_model_len,
                mamba_groups=3,
            ),
            async_scheduling=async_scheduling,
        )
    finally:
        if not plugin:
            hybrid_kv_plugin.register()
