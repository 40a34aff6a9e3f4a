"""Replay a Mooncake trace on a cluster: N engines behind a router, one step clock.

Each engine is a :class:`~hybrid_kv_plugin.sim.engine.SimEngine` built as the
single-engine replay builds it (the wheel's real Scheduler, KVCacheManager and SimpleCPU
connector, its own GPU cache). The CPU tier is either one per engine (``per-engine``,
``cpu_blocks`` each) or one shared by all (``shared``, ``N x cpu_blocks``: a store the
engines all contribute their memory to; :mod:`hybrid_kv_plugin.sim.shared_tier`).

Time: request ``i`` arrives at step ``wave`` (its timestamp / step_ms) on the engine the
router gives it; every global step, each engine with work takes one step, in engine
order, so a store an engine completes in a step is visible to the engines after it in
that step and to all of them in the next. With no work anywhere the clock jumps to the
next arrival. Routers: ``round-robin`` (arrival order, ``i mod N``) and ``session``
(every turn of a conversation on the engine its first turn got; conversations are dealt
round-robin in the order they start).

Invariant: ``engines=1`` with either tier is the single-engine timed replay (same
engine, same arrivals, same steps), which the tests assert.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybrid_kv_plugin.sim.configs import ReplayConfig
from hybrid_kv_plugin.sim.workload import ideal_reuse

ROUTERS = ("round-robin", "session")
TIERS = ("per-engine", "shared")


class ClusterInputError(ValueError):
    """An input the cluster replay cannot run (the message is the whole answer)."""


# ---------------------------------------------------------------------------- sessions
def session_parents(hash_id_lines: Iterable[tuple[list[int], int]], block_tokens: int) -> list[int]:
    """Per request (file order): the earlier request it continues, or -1.

    ``hash_id_lines``: (hash ids, input length) per request. The rule is the
    ``continuation`` conversation model's (:mod:`hybrid_kv_plugin.sim.conversation`): the
    latest earlier request sharing the most leading hash ids, whose prompt ended in a
    partial block, all of whose full blocks this one shares, and which this one extends.
    The caller checks the count against the prompt builder's ``continued_requests``.
    """
    children: dict[tuple[int, int], int] = {}
    latest: list[int] = [-1]
    lengths: list[int] = []
    parents: list[int] = []
    for request, (hash_ids, input_length) in enumerate(hash_id_lines):
        node, shared, last = 0, 0, -1
        for hash_id in hash_ids:
            child = children.get((node, hash_id))
            if child is None:
                child = len(latest)
                children[(node, hash_id)] = child
                latest.append(request)
            else:
                shared += 1
                last = latest[child]
                latest[child] = request
            node = child
        parent = -1
        if last >= 0:
            earlier = lengths[last]
            full = earlier // block_tokens
            if earlier % block_tokens and full >= 1 and shared == full and input_length > earlier:
                parent = last
        parents.append(parent)
        lengths.append(input_length)
    return parents


def route(num_requests: int, engines: int, router: str, parents: Sequence[int] | None = None) -> list[int]:
    """The engine of each request (file order)."""
    if router == "round-robin":
        return [i % engines for i in range(num_requests)]
    if router != "session":
        raise ClusterInputError(f"router {router!r} (allowed: {', '.join(ROUTERS)})")
    if parents is None or not any(p >= 0 for p in parents):
        raise ClusterInputError("--router session needs a trace with conversations (no request continues another)")
    out: list[int] = []
    started = 0
    for i in range(num_requests):
        parent = parents[i]
        if parent >= 0:
            out.append(out[parent])
        else:
            out.append(started % engines)
            started += 1
    return out


# ---------------------------------------------------------------------------- results
@dataclass
class EngineResult:
    index: int
    requests: int = 0
    prompt_tokens: int = 0
    ideal_tokens: int = 0
    reused_gpu_tokens: int = 0  # its own GPU prefix cache
    reused_cpu_own_tokens: int = 0  # its own CPU tier, or shared-store bytes it wrote itself
    reused_cpu_other_tokens: int = 0  # shared-store bytes another engine wrote
    steps: int = 0
    byte_loads: int | None = None  # loads the byte check verified (None: byte check off)

    @property
    def reused_tokens(self) -> int:
        return self.reused_gpu_tokens + self.reused_cpu_own_tokens + self.reused_cpu_other_tokens

    @property
    def efficiency(self) -> float:
        return self.reused_tokens / self.ideal_tokens if self.ideal_tokens else 1.0

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items()}
        out["reused_tokens"] = self.reused_tokens
        out["efficiency"] = round(self.efficiency, 4)
        return out


@dataclass
class ClusterResult:
    config: str
    engines: int
    router: str
    tier: str
    cpu_blocks_per_engine: int
    cpu_blocks_total: int
    per_engine: list[EngineResult] = field(default_factory=list)
    cpu_evictions: int = 0
    unattributed_blocks: int = 0  # loaded attention blocks with no recorded writer
    per_request: dict[str, dict[str, int]] = field(default_factory=dict)
    refused: str | None = None

    def _sum(self, name: str) -> int:
        return sum(getattr(e, name) for e in self.per_engine)

    @property
    def reused_tokens(self) -> int:
        return self._sum("reused_tokens")

    @property
    def ideal_tokens(self) -> int:
        return self._sum("ideal_tokens")

    @property
    def efficiency(self) -> float:
        ideal = self.ideal_tokens
        return self.reused_tokens / ideal if ideal else 1.0

    def as_dict(self, per_request: bool = False) -> dict[str, Any]:
        if self.refused is not None:
            return {"config": self.config, "engines": self.engines, "tier": self.tier, "refused": self.refused}
        out: dict[str, Any] = {
            "config": self.config,
            "engines": self.engines,
            "router": self.router,
            "tier": self.tier,
            "cpu_blocks_per_engine": self.cpu_blocks_per_engine,
            "cpu_blocks_total": self.cpu_blocks_total,
            "requests": self._sum("requests"),
            "prompt_tokens": self._sum("prompt_tokens"),
            "ideal_tokens": self.ideal_tokens,
            "reused_tokens": self.reused_tokens,
            "efficiency": round(self.efficiency, 4),
            "hits_by_source": {
                "own_gpu": self._sum("reused_gpu_tokens"),
                "own_cpu": self._sum("reused_cpu_own_tokens"),
                "other_engine_cpu": self._sum("reused_cpu_other_tokens"),
            },
            "steps": self._sum("steps"),
            "cpu_evictions": self.cpu_evictions,
            "unattributed_blocks": self.unattributed_blocks,
            "per_engine": [e.as_dict() for e in self.per_engine],
        }
        if per_request:
            out["per_request"] = self.per_request
        return out


# ---------------------------------------------------------------------------- running
@contextlib.contextmanager
def _registered(config: ReplayConfig) -> Iterator[str | None]:
    """The plugin registered for a plugin configuration (unregistered otherwise), restored after.

    Yields the refusal message when the plugin does not activate on this wheel.
    """
    import hybrid_kv_plugin
    from hybrid_kv_plugin.registration import STATE, Status

    was_active = STATE.status is Status.ACTIVE
    keep = was_active and config.plugin
    if not keep:
        hybrid_kv_plugin.uninstall()
    try:
        refused = None
        if config.plugin and not keep:
            hybrid_kv_plugin.register()
            if STATE.status is not Status.ACTIVE:
                refused = f"the plugin is {STATE.status} on this vLLM: {STATE.reason}"
        yield refused
    finally:
        if not keep:
            hybrid_kv_plugin.uninstall()
            if was_active:
                hybrid_kv_plugin.register()


def replay_cluster(
    segment: Any,
    settings: Any,
    config: ReplayConfig,
    *,
    engines: int,
    tier: str,
    assignment: Sequence[int],
    router: str = "round-robin",
    byte_check: bool | None = None,
    per_request: bool = False,
    progress: Callable[[int], None] | None = None,
) -> ClusterResult:
    """Run one timed segment (arrivals by ``wave``) on ``engines`` engines.

    ``assignment[i]``: the engine of ``segment.requests[i]`` (see :func:`route`).
    ``settings.cpu_blocks`` is one engine's CPU tier; the shared tier holds ``engines`` times it.
    """
    from hybrid_kv_plugin.config import PluginConfigError
    from hybrid_kv_plugin.sim.engine import SimEngine, TransferPolicy
    from hybrid_kv_plugin.sim.shared_tier import SourceLedger, share_cpu_tier

    if engines < 1:
        raise ClusterInputError(f"engines must be >= 1, got {engines}")
    if tier not in TIERS:
        raise ClusterInputError(f"tier {tier!r} (allowed: {', '.join(TIERS)})")
    if len(assignment) != len(segment.requests) or any(not 0 <= a < engines for a in assignment):
        raise ClusterInputError("the assignment must give every request an engine in range")
    shared = tier == "shared"
    cpu_blocks = settings.cpu_blocks * (engines if shared else 1)
    result = ClusterResult(
        config.name, engines, router, tier, settings.cpu_blocks, settings.cpu_blocks * engines
    )
    geometry = settings.geometry(segment)
    with _registered(config) as refused:
        if refused is not None:
            result.refused = refused
            return result
        try:
            sims = [
                SimEngine(
                    geometry,
                    kv_connector=config.connector,
                    kv_connector_extra_config={"cpu_bytes_to_use": cpu_blocks * geometry.attention_page_bytes},
                    additional_config=config.additional_config(geometry.eagle),
                    transfer_policy=TransferPolicy(delay_steps=settings.transfer_delay_steps),
                    byte_check=byte_check,
                )
                for _ in range(engines)
            ]
        except PluginConfigError as exc:
            result.refused = str(exc)
            return result
        if shared and engines > 1:
            share_cpu_tier(sims)
        ledger = SourceLedger()
        if sims[0].offload_manager is not None:
            for index, sim in enumerate(sims):
                ledger.watch(index, sim)
        _drive(sims, segment.requests, assignment, progress)
        for sim in sims:
            if sim.byte_cache is not None:
                sim.byte_cache.check()
    ideal = ideal_reuse(segment.requests, sims[0].hash_block_size)
    result.per_engine = [EngineResult(i, steps=len(sim.steps)) for i, sim in enumerate(sims)]
    for i, sim in enumerate(sims):
        if sim.byte_cache is not None:
            result.per_engine[i].byte_loads = sim.byte_cache.stats.loads
    for request, index in zip(segment.requests, assignment):
        rid = request.request_id
        row = result.per_engine[index]
        outcome = sims[index].outcomes[rid]
        hit = outcome.hit_tokens or 0
        external = outcome.external_tokens
        other = min(ledger.from_other.get(rid, 0), external) if external else 0
        row.requests += 1
        row.prompt_tokens += len(request.prompt_token_ids)
        row.ideal_tokens += ideal[rid]
        row.reused_gpu_tokens += hit - external
        row.reused_cpu_own_tokens += external - other
        row.reused_cpu_other_tokens += other
        if per_request:
            result.per_request[rid] = {"engine": index, "ideal": ideal[rid], "reused": hit, "cpu": external, "cpu_other": other}
    result.cpu_evictions = sum(ledger.cpu_evictions.values())
    result.unattributed_blocks = ledger.unknown
    return result


def _drive(
    sims: Sequence[Any],
    requests: Sequence[Any],
    assignment: Sequence[int],
    progress: Callable[[int], None] | None,
) -> None:
    """Lock-step the engines on one clock, each adding its own requests at their arrival steps."""
    queues: list[deque[Any]] = [deque() for _ in sims]
    for request, index in sorted(zip(requests, assignment), key=lambda pair: pair[0].wave):
        queues[index].append(request)
    clock = 0
    done = 0
    while any(queues) or any(sim.has_work() for sim in sims):
        if not any(sim.has_work() for sim in sims):
            clock = max(clock, min(q[0].wave for q in queues if q))  # all idle: jump to the next arrival
        for sim, queue in zip(sims, queues):
            while queue and queue[0].wave <= clock:
                request = queue.popleft()
                sim.add_request(request.request_id, list(request.prompt_token_ids), max_tokens=request.max_tokens)
        for sim in sims:
            if sim.has_work():
                finished = sim.step().finished
                if finished:
                    done += len(finished)
                    if progress:
                        progress(done)
        clock += 1
