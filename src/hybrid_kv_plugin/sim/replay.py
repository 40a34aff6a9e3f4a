"""Replay a workload through the real scheduler once per configuration (stock vs plugin)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybrid_kv_plugin.sim.geometry import HybridGeometry
from hybrid_kv_plugin.sim.workload import TraceRequest, ideal_reuse

STOCK_CONNECTOR = "SimpleCPUOffloadConnector"


@dataclass(frozen=True)
class ReplayConfig:
    name: str
    plugin: bool
    mamba_shared_prefix_checkpoint: bool = False

    @property
    def connector(self) -> str:
        from hybrid_kv_plugin import CONNECTOR_NAME

        return CONNECTOR_NAME if self.plugin else STOCK_CONNECTOR


DEFAULT_CONFIGS = (ReplayConfig("stock", plugin=False), ReplayConfig("plugin", plugin=True))


@dataclass
class ReplayResult:
    name: str
    requests: int
    prompt_tokens: int
    ideal_tokens: int
    reused_gpu_tokens: int
    reused_cpu_tokens: int
    steps: int
    per_request: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def reused_tokens(self) -> int:
        return self.reused_gpu_tokens + self.reused_cpu_tokens

    @property
    def lost_tokens(self) -> int:
        return sum(max(r["ideal"] - r["reused"], 0) for r in self.per_request.values())

    @property
    def efficiency(self) -> float:
        return self.reused_tokens / self.ideal_tokens if self.ideal_tokens else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "ideal_tokens": self.ideal_tokens,
            "reused_tokens": self.reused_tokens,
            "reused_gpu_tokens": self.reused_gpu_tokens,
            "reused_cpu_tokens": self.reused_cpu_tokens,
            "lost_tokens": self.lost_tokens,
            "efficiency": round(self.efficiency, 4),
            "steps": self.steps,
        }


def replay(
    workload: Sequence[TraceRequest],
    geometry: HybridGeometry,
    config: ReplayConfig,
    *,
    cpu_bytes: int = 1 << 26,
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Run ``workload`` wave by wave; the plugin is registered (or not) for this run only."""
    import hybrid_kv_plugin
    from hybrid_kv_plugin.registration import STATE
    from hybrid_kv_plugin.sim.engine import SimEngine

    was_active = STATE.status == "active"
    hybrid_kv_plugin.uninstall()
    if config.plugin:
        hybrid_kv_plugin.register()
        if STATE.status != "active":
            raise RuntimeError(f"the plugin is not active on this vLLM: {STATE.reason}")
    try:
        additional = {"hybrid_kv": {"mamba_shared_prefix_checkpoint": True}} if config.mamba_shared_prefix_checkpoint else None
        engine = SimEngine(
            geometry,
            kv_connector=config.connector,
            kv_connector_extra_config={"cpu_bytes_to_use": cpu_bytes},
            additional_config=additional,
        )
        ideal = ideal_reuse(workload, engine.hash_block_size)
        waves: dict[int, list[TraceRequest]] = {}
        for request in workload:
            waves.setdefault(request.wave, []).append(request)
        done = 0
        for wave in sorted(waves):
            batch = waves[wave]
            if any(r.evict_gpu_before for r in batch):
                if not engine.reset_prefix_cache():
                    raise RuntimeError(f"wave {wave}: the GPU prefix cache could not be reset")
            for request in batch:
                engine.add_request(request.request_id, request.prompt_token_ids, max_tokens=request.max_tokens)
            engine.run_until_idle()
            done += len(batch)
            if progress:
                progress(done)
    finally:
        hybrid_kv_plugin.uninstall()
        if was_active:
            hybrid_kv_plugin.register()

    result = ReplayResult(
        name=config.name,
        requests=len(workload),
        prompt_tokens=sum(len(r.prompt_token_ids) for r in workload),
        ideal_tokens=sum(ideal.values()),
        reused_gpu_tokens=0,
        reused_cpu_tokens=0,
        steps=len(engine.steps),
    )
    for request in workload:
        outcome = engine.outcomes[request.request_id]
        hit = outcome.hit_tokens or 0
        result.reused_cpu_tokens += outcome.external_tokens
        result.reused_gpu_tokens += hit - outcome.external_tokens
        result.per_request[request.request_id] = {
            "prompt": len(request.prompt_token_ids),
            "ideal": ideal[request.request_id],
            "reused": hit,
            "cpu": outcome.external_tokens,
        }
    return result
