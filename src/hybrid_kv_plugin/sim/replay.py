"""Replay a workload through the installed wheel's real scheduler, once per configuration.

A configuration is the stock SimpleCPU connector with the plugin unregistered, or the
plugin registered with ``HybridSimpleCPUConnector`` (junction switch off / on). Each
workload segment runs on a fresh :class:`~hybrid_kv_plugin.sim.engine.SimEngine`; the
plugin is registered for the configuration's run only and the caller's registration
state is restored afterwards.

With ``observe=True`` the run also records the facts the loss attribution needs
(:mod:`hybrid_kv_plugin.sim.attribution`): it wraps, on this engine's instances only,
the scheduler's ``update_from_output``, the connector's ``build_connector_meta`` and
``get_num_new_matched_tokens``, and the CPU pool's eviction hook. Wrappers only read;
every answer vLLM gives is passed through unchanged. The benchmark runs unobserved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybrid_kv_plugin.offload.stats import BoundaryStoreStats
from hybrid_kv_plugin.sim.attribution import Admission, Bucket, Fate, MambaGrid, fate_of_step, split_loss, total
from hybrid_kv_plugin.sim.configs import ReplayConfig
from hybrid_kv_plugin.sim.geometry import HybridGeometry
from hybrid_kv_plugin.sim.mamba_states import MambaStateCounter
from hybrid_kv_plugin.sim.mamba_states import merge as merge_mamba_states
from hybrid_kv_plugin.sim.mooncake import TimedSegment, run_timed
from hybrid_kv_plugin.sim.wheel import boundary_handoffs, boundary_handoffs_published
from hybrid_kv_plugin.sim.workload import Segment, TraceRequest, history_keys, ideal_reuse

# The boundary-store counters, in the order the report prints them.
STORE_FIELDS = tuple(f.name for f in dataclasses.fields(BoundaryStoreStats))


@dataclass(frozen=True)
class ReplaySettings:
    """Geometry and pool sizes shared by every segment (EAGLE may differ per segment)."""

    attention_block_size: int = 16
    mamba_block_size: int = 64
    hash_block_size: int = 16  # the prefix-match unit
    mamba_cache_mode: str = "align"
    gpu_blocks: int = 1024
    cpu_blocks: int = 8192
    eagle: bool = False  # for segments that do not choose
    num_speculative_tokens: int = 1
    # Steps the simulated worker takes to complete a connector transfer (in-flight stores
    # hold their CPU blocks meanwhile).
    transfer_delay_steps: int = 0
    # None: long enough for the segment's longest request (a resolved model sets its own).
    max_model_len: int | None = None
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 64
    # Blocks one Mamba state takes (the resolved model's Mamba groups; sim/geometry.py).
    mamba_groups: int = 1
    # The engine core's scheduler: vLLM's AsyncScheduler (a GPU `vllm serve`'s default) or Scheduler;
    # None: the driver's default (sim.engine.default_scheduling, Scheduler unless a caller chose).
    async_scheduling: bool | None = None

    def geometry(self, segment: Segment) -> HybridGeometry:
        max_model_len = self.max_model_len
        if max_model_len is None:
            longest = max((len(r.prompt_token_ids) + r.max_tokens for r in segment.requests), default=0)
            max_model_len = max(4096, longest + 64)
        return HybridGeometry(
            attention_block_size=self.attention_block_size,
            mamba_block_size=self.mamba_block_size,
            hash_block_size=self.hash_block_size,
            mamba_cache_mode=self.mamba_cache_mode,
            num_gpu_blocks=self.gpu_blocks,
            max_model_len=max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            eagle=self.eagle if segment.eagle is None else segment.eagle,
            num_speculative_tokens=self.num_speculative_tokens,
            mamba_groups=self.mamba_groups,
        )


@dataclass
class SegmentResult:
    name: str
    eagle: bool
    requests: int
    prompt_tokens: int
    ideal_tokens: int
    reused_gpu_tokens: int
    reused_cpu_tokens: int
    steps: int
    cpu_blocks: int | None
    loss: dict[str, int] | None  # None: the run was not observed
    boundary_stats: dict[str, int] | None  # None: the connector has no counters
    cpu_evictions: int | None = None
    per_request: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Timed (Mooncake) segments: steps from arrival to first token, per request.
    ttft_steps: dict[str, int] | None = None
    # With ``check_invariants``: loaded blocks and published CPU copies the offload
    # invariants checked (None: not checked, or no CPU tier).
    checked_loads: int | None = None
    checked_copies: int | None = None
    # Observed runs: Mamba states held (GPU prefix cache, CPU tier) and prefill chunks (sim/mamba_states.py).
    mamba_states: dict[str, Any] | None = None


def _total(attr: str) -> Any:
    """A read-only property summing one :class:`SegmentResult` field over the segments."""
    return property(lambda self: sum(getattr(s, attr) for s in self.segments))


@dataclass
class ReplayResult:
    name: str
    segments: list[SegmentResult] = field(default_factory=list)
    refused: str | None = None  # the configuration could not start on this wheel (the message)

    requests = _total("requests")
    prompt_tokens = _total("prompt_tokens")
    ideal_tokens = _total("ideal_tokens")
    reused_gpu_tokens = _total("reused_gpu_tokens")
    reused_cpu_tokens = _total("reused_cpu_tokens")
    steps = _total("steps")

    @property
    def reused_tokens(self) -> int:
        return self.reused_gpu_tokens + self.reused_cpu_tokens

    @property
    def lost_tokens(self) -> int:
        return sum(
            max(r["ideal"] - r["reused"], 0) for s in self.segments for r in s.per_request.values()
        )

    @property
    def efficiency(self) -> float:
        return self.reused_tokens / self.ideal_tokens if self.ideal_tokens else 1.0

    @property
    def loss(self) -> dict[str, int] | None:
        if any(s.loss is None for s in self.segments):
            return None
        sums = {b.value: 0 for b in Bucket}
        for segment in self.segments:
            for bucket, tokens in (segment.loss or {}).items():
                sums[bucket] += tokens
        return sums

    @property
    def reachable_tokens(self) -> int | None:
        """The ideal less what no cache could serve (no Mamba state there, or EAGLE's dropped block)."""
        loss = self.loss
        if loss is None:
            return None
        return self.ideal_tokens - loss[Bucket.NO_MAMBA_STATE.value] - loss[Bucket.EAGLE_PRUNE.value]

    @property
    def boundary_stats(self) -> dict[str, int] | None:
        if any(s.boundary_stats is None for s in self.segments):
            return None
        return {f: sum((s.boundary_stats or {})[f] for s in self.segments) for f in STORE_FIELDS}

    def summary(self) -> dict[str, Any]:
        """The report's numbers for this configuration (no per-request detail)."""
        if self.refused is not None:
            return {"name": self.name, "refused": self.refused}
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
            "reachable_tokens": self.reachable_tokens,
            "efficiency_of_reachable": _ratio(self.reused_tokens, self.reachable_tokens),
            "steps": self.steps,
            "loss": self.loss,
            "boundary_stats": self.boundary_stats,
            "mamba_states": merge_mamba_states(s.mamba_states for s in self.segments),
            **self._ttft(),
        }

    def _ttft(self) -> dict[str, Any]:
        timed = [s.ttft_steps for s in self.segments if s.ttft_steps is not None]
        if not timed:
            return {}
        return {"ttft_steps": ttft_summary({rid: v for t in timed for rid, v in t.items()})}

    def as_dict(self, per_request: bool = False) -> dict[str, Any]:
        out = self.summary()
        if self.refused is None:
            out["segments"] = [_segment_dict(s, per_request) for s in self.segments]
        return out


def _ratio(part: int, whole: int | None) -> float | None:
    if whole is None:
        return None
    return round(part / whole, 4) if whole else 1.0


def _segment_dict(segment: SegmentResult, per_request: bool) -> dict[str, Any]:
    reused = segment.reused_gpu_tokens + segment.reused_cpu_tokens
    out: dict[str, Any] = {
        "name": segment.name,
        "eagle": segment.eagle,
        "requests": segment.requests,
        "prompt_tokens": segment.prompt_tokens,
        "ideal_tokens": segment.ideal_tokens,
        "reused_tokens": reused,
        "reused_gpu_tokens": segment.reused_gpu_tokens,
        "reused_cpu_tokens": segment.reused_cpu_tokens,
        "efficiency": round(reused / segment.ideal_tokens, 4) if segment.ideal_tokens else 1.0,
        "steps": segment.steps,
        "cpu_blocks": segment.cpu_blocks,
        "cpu_evictions": segment.cpu_evictions,
        "loss": segment.loss,
        "boundary_stats": segment.boundary_stats,
    }
    if segment.ttft_steps is not None:
        out["ttft_steps"] = ttft_summary(segment.ttft_steps)
    if per_request:
        out["per_request"] = segment.per_request
    return out


def ttft_summary(ttft: dict[str, int]) -> dict[str, float]:
    """Mean and percentiles of the TTFT proxy (scheduler steps from arrival to first token)."""
    values = sorted(ttft.values())
    if not values:
        return {"mean": 0.0, "p50": 0, "p90": 0, "p99": 0, "max": 0}

    def pct(q: float) -> int:
        return values[min(len(values) - 1, int(q * len(values)))]

    return {"mean": round(sum(values) / len(values), 1), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "max": values[-1]}


# ---------------------------------------------------------------------------- running
class StepTimer:
    """CPU time spent inside ``scheduler.schedule()`` + ``update_from_output()`` (nothing else)."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        import time

        self.clock = clock or time.process_time
        # Per step, in order over every segment: schedule() + its update_from_output().
        self.per_step: list[float] = []

    def install(self, scheduler: Any) -> None:
        import gc

        # As vLLM's engine core does once started (``freeze_gc_heap``): the heap built so far
        # (imports, this engine) leaves the collector's view, so a full collection that lands in a
        # timed step scans what the steps allocate, not ~1 s of start-up objects (14x outliers).
        # ``run_case`` unfreezes after each run.
        gc.freeze()
        clock = self.clock
        schedule, update = scheduler.schedule, scheduler.update_from_output
        per_step = self.per_step

        def timed_schedule() -> Any:
            start = clock()
            out = schedule()
            per_step.append(clock() - start)
            return out

        def timed_update(scheduler_output: Any, model_runner_output: Any) -> Any:
            start = clock()
            out = update(scheduler_output, model_runner_output)
            per_step[-1] += clock() - start
            return out

        scheduler.schedule = timed_schedule
        scheduler.update_from_output = timed_update


def replay(
    segments: Sequence[Segment],
    settings: ReplaySettings,
    config: ReplayConfig,
    *,
    observe: bool = True,
    per_request: bool = True,
    progress: Callable[[int], None] | None = None,
    timer: StepTimer | None = None,
    check_invariants: bool = False,
) -> ReplayResult:
    """Run every segment under ``config``; the plugin is registered (or not) for this run only
    (a plugin run where the caller already registered it keeps that registration).

    ``check_invariants``: watch the CPU tier with :class:`~hybrid_kv_plugin.sim.invariants.OffloadInvariants`
    and raise ``AssertionError`` at the end of a segment that violated one.

    ``progress(n)`` is called with the number of requests done so far (all segments).
    """
    import hybrid_kv_plugin
    from hybrid_kv_plugin.config import PluginConfigError
    from hybrid_kv_plugin.registration import STATE, Status, current_adapter

    was_active = STATE.status is Status.ACTIVE
    # A plugin run in a process that keeps the plugin registered (as a server does; the
    # bench's per-configuration processes) leaves it in place: re-installing the patches
    # around every run is not what a server pays.
    keep = was_active and config.plugin
    if not keep:
        hybrid_kv_plugin.uninstall()
    result = ReplayResult(config.name)
    try:
        if config.plugin and not keep:
            hybrid_kv_plugin.register()
            if STATE.status is not Status.ACTIVE:
                result.refused = f"the plugin is {STATE.status} on this vLLM: {STATE.reason}"
                return result
        done = 0
        for segment in segments:
            try:
                refusal = config.refusal(current_adapter())
                if refusal is not None:
                    raise PluginConfigError(refusal)
                run = _SegmentRun(segment, settings, config, observe=observe, timer=timer, check_invariants=check_invariants)
            except PluginConfigError as exc:
                result.refused = str(exc)
                return result
            except ValueError as exc:
                # vLLM's own start-up refusal of a stock knob (a retention interval off its grid).
                if config.retention is None or "retention_interval" not in str(exc).lower():
                    raise
                result.refused = f"vLLM refuses it: {exc}"
                return result
            done = run.run(progress, done)
            result.segments.append(run.result(per_request))
    finally:
        if not keep:
            hybrid_kv_plugin.uninstall()
            if was_active:
                hybrid_kv_plugin.register()
    return result


@dataclass
class _Pending:
    """What the connector was asked for one request before its first scheduling."""

    local: int  # the block-aligned local hit the scheduler handed to the connector
    beyond: int  # what the CPU tier held contiguously beyond it
    grid_units: int
    grid_fate: Fate
    cpu_evicted_before: bool


class _SegmentRun:
    def __init__(
        self,
        segment: Segment,
        settings: ReplaySettings,
        config: ReplayConfig,
        *,
        observe: bool,
        timer: StepTimer | None,
        check_invariants: bool = False,
    ) -> None:
        from hybrid_kv_plugin.registration import current_adapter
        from hybrid_kv_plugin.sim.engine import SimEngine, TransferPolicy

        self.segment = segment
        adapter = current_adapter()
        self.geometry = config.engine_geometry(settings.geometry(segment), adapter)
        additional = config.additional_config(self.geometry.eagle)
        # One CPU block holds one page of the shared KV tensor (SimpleCPU sizes its pool
        # as cpu_bytes // page bytes for this single-tensor layout).
        cpu_bytes = settings.cpu_blocks * self.geometry.attention_page_bytes
        with config.engine_environment(self.geometry, adapter):
            self.engine = SimEngine(
                self.geometry,
                kv_connector=config.connector,
                kv_connector_extra_config={"cpu_bytes_to_use": cpu_bytes, **config.connector_extra_config()},
                additional_config=additional,
                transfer_policy=TransferPolicy(delay_steps=settings.transfer_delay_steps),
                async_scheduling=settings.async_scheduling,
            )
        self.unit = self.engine.hash_block_size
        # Each request's history keys (uint64 arrays, 8 bytes a unit): the ideal and the
        # observers' Mamba grid both read them, so they are built once.
        keys = [history_keys(r, self.unit) for r in segment.requests]
        self.ideal = ideal_reuse(segment.requests, self.unit, keys=keys)
        self.keys = {r.request_id: k for r, k in zip(segment.requests, keys)}
        self.requests: dict[str, TraceRequest] = {r.request_id: r for r in segment.requests}
        self.ttft_steps: dict[str, int] | None = None
        self.observed = observe
        self.cpu_evictions = 0
        self.states = MambaStateCounter(self.engine) if observe else None
        if observe:
            self._install_observers()
        if timer is not None:
            timer.install(self.engine.scheduler)
        self.invariants = None
        if check_invariants and self.engine.offload_manager is not None:
            from hybrid_kv_plugin.sim.invariants import OffloadInvariants

            self.invariants = OffloadInvariants(self.engine)

    # ------------------------------------------------------------------ driving
    def run(self, progress: Callable[[int], None] | None, done: int) -> int:
        engine = self.engine
        if isinstance(self.segment, TimedSegment):
            done, self.ttft_steps = run_timed(engine, self.segment, progress, done)
            if engine.byte_cache is not None:  # run_timed steps itself, not through run_until_idle
                engine.byte_cache.check()
        else:
            done = self._run_waves(progress, done)
        if self.invariants is not None:
            self.invariants.check()
        return done

    def _run_waves(self, progress: Callable[[int], None] | None, done: int) -> int:
        engine = self.engine
        waves: dict[int, list[TraceRequest]] = {}
        for request in self.segment.requests:
            waves.setdefault(request.wave, []).append(request)
        for wave in sorted(waves):
            batch = waves[wave]
            if any(r.evict_gpu_before for r in batch) and not engine.reset_prefix_cache():
                raise RuntimeError(f"segment {self.segment.name}, wave {wave}: the GPU prefix cache could not be reset")
            for request in batch:
                engine.add_request(request.request_id, request.prompt_token_ids, max_tokens=request.max_tokens)
            engine.run_until_idle()
            done += len(batch)
            if progress:
                progress(done)
        return done

    def result(self, per_request: bool) -> SegmentResult:
        requests = self.segment.requests
        out = SegmentResult(
            name=self.segment.name,
            eagle=self.geometry.eagle,
            requests=len(requests),
            prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
            ideal_tokens=sum(self.ideal.values()),
            reused_gpu_tokens=0,
            reused_cpu_tokens=0,
            steps=len(self.engine.steps),
            cpu_blocks=getattr(self.engine.offload_manager, "num_cpu_blocks", None),
            loss=None,
            boundary_stats=self._store_stats(),
            cpu_evictions=self.cpu_evictions if self.observed else None,
            ttft_steps=self.ttft_steps,
            checked_loads=len(self.invariants.loads) if self.invariants is not None else None,
            checked_copies=self.invariants.published_checked if self.invariants is not None else None,
            mamba_states=(
                self.states.counts({r.request_id: len(r.prompt_token_ids) for r in requests}) if self.states else None
            ),
        )
        buckets: dict[str, dict[Bucket, int]] = {}
        for request in requests:
            rid = request.request_id
            outcome = self.engine.outcomes[rid]
            hit = outcome.hit_tokens or 0
            out.reused_cpu_tokens += outcome.external_tokens
            out.reused_gpu_tokens += hit - outcome.external_tokens
            row: dict[str, Any] = {
                "prompt": len(request.prompt_token_ids),
                "ideal": self.ideal[rid],
                "reused": hit,
                "cpu": outcome.external_tokens,
            }
            if self.observed:
                buckets[rid] = split_loss(self._admission(rid, hit))
                row["loss"] = {b.value: n for b, n in buckets[rid].items()}
            if per_request:
                out.per_request[rid] = row
            else:
                out.per_request[rid] = {"ideal": row["ideal"], "reused": hit}
        if self.observed:
            out.loss = total(buckets)
        return out

    # ------------------------------------------------------------------ observation
    def _store_stats(self) -> dict[str, int] | None:
        """The connector's boundary-store counters, where it has them."""
        read = getattr(self.engine.connector, "get_boundary_store_stats", None)
        if read is None:
            return None
        stats = read()
        return {f: int(getattr(stats, f, 0)) for f in STORE_FIELDS}

    def _install_observers(self) -> None:
        engine = self.engine
        scheduler = engine.scheduler
        connector = engine.connector
        self.grid = MambaGrid()
        self.pending: dict[str, _Pending] = {}
        self._dense_grid = not boundary_handoffs_published(engine.adapter)
        # Requests the connector was asked about and not yet seen scheduled / finished; kept
        # small so per-step bookkeeping does not grow with the workload.
        self._asked: set[str] = set()
        self._running: set[str] = set()

        # The hand-offs live on the scheduler output only while the connector builds its
        # metadata (the scheduler clears them before the output leaves ``schedule()``), and
        # the connector counts its store outcomes right there.
        build = connector.build_connector_meta

        def observed_build(scheduler_output: Any) -> Any:
            handoffs = boundary_handoffs(engine.adapter, scheduler_output)
            if not handoffs:  # the counters' growth only decides hand-offs' fates: none to read
                return build(scheduler_output)
            leaving = set(getattr(scheduler_output, "finished_req_ids", ()) or ())
            leaving |= set(getattr(scheduler_output, "preempted_req_ids", ()) or ())
            gone = {rid for rid in handoffs if rid in leaving or rid not in scheduler.requests}
            before = self._store_stats()
            meta = build(scheduler_output)
            admission = getattr(connector, "request_end_admission", None)
            declined = admission.declined_this_step if admission is not None else ()
            self._record_handoffs(handoffs, gone, before, self._store_stats(), declined)
            return meta

        connector.build_connector_meta = observed_build

        update = scheduler.update_from_output

        def observed_update(scheduler_output: Any, model_runner_output: Any) -> Any:
            out = update(scheduler_output, model_runner_output)
            self._end_step()
            self.states.after_step(getattr(scheduler, "finished_req_ids", ()))
            return out

        scheduler.update_from_output = observed_update

        ask = connector.get_num_new_matched_tokens

        def observed_lookup(request: Any, num_computed_tokens: int) -> Any:
            self._before_lookup(request, num_computed_tokens)
            return ask(request, num_computed_tokens)

        connector.get_num_new_matched_tokens = observed_lookup

        pool = getattr(engine.offload_manager, "cpu_block_pool", None)
        evict = getattr(pool, "_maybe_evict_cached_block", None)
        if evict is not None:

            def counted_evict(block: Any) -> Any:
                evicted = evict(block)
                if evicted:
                    self.cpu_evictions += 1
                return evicted

            pool._maybe_evict_cached_block = counted_evict

    def _before_lookup(self, request: Any, local: int) -> None:
        rid = request.request_id
        outcome = self.engine.outcomes.get(rid)
        if rid not in self.requests or outcome is None or outcome.hit_tokens is not None:
            return  # not ours, or a re-admission after preemption: the first answer counts
        ideal = self.ideal[rid]
        beyond = 0
        coordinator = getattr(self.engine.offload_manager, "cpu_coordinator", None)
        if coordinator is not None and ideal > local and local % self.unit == 0:
            # The connector's own question (the CPU tier beyond the local prefix), asked of
            # its CPU coordinator read-only and capped at what the request shares.
            hashes = request.block_hashes[local // self.unit :]
            _blocks, beyond, _uncached = coordinator.find_longest_cache_hit(hashes, ideal - local)
        # Under EAGLE a state at the ideal itself is out of reach (see attribution step 0).
        self._asked.add(rid)
        limit = max((ideal - self._eagle_drop()) // self.unit, 0)
        units, fate = self.grid.best(self.keys[rid][:limit].tolist(), limit)
        self.pending[rid] = _Pending(local, beyond, units * self.unit, fate, self.cpu_evictions > 0)

    def _eagle_drop(self) -> int:
        """Tokens the EAGLE lookup matches beyond a hit and drops: one full-attention block."""
        return self.geometry.attention_block_size if self.geometry.eagle else 0

    def _record_handoffs(
        self,
        handoffs: dict[str, list[int]],
        gone: set[str],
        before: dict[str, int] | None,
        after: dict[str, int] | None,
        declined: Any = (),
    ) -> None:
        """``declined``: (request id, position) of hand-offs the connector's admission kept off the
        CPU tier (``cpu_tier_request_ends: skip``): each gets its own fate, not the step's."""
        growth = None if before is None or after is None else {k: after[k] - before[k] for k in STORE_FIELDS}
        fate = fate_of_step(growth)
        for rid, positions in handoffs.items():
            if rid not in self.requests:
                continue
            # A connector with counters declines every hand-off of a request that is leaving.
            state_fate = Fate.DROPPED if rid in gone and fate is not Fate.UNKNOWN else fate
            for position in positions:
                self._add_state(rid, position, Fate.DROPPED if (rid, position) in declined else state_fate)

    def _end_step(self) -> None:
        outcomes = self.engine.outcomes
        for rid in [r for r in self._asked if outcomes[r].hit_tokens is not None]:
            self._asked.discard(rid)
            if self._dense_grid:
                self._running.add(rid)
            outcome = outcomes[rid]
            # A served position proves a state there; served from the CPU proves it was offloaded.
            self._add_state(rid, outcome.hit_tokens, Fate.KEPT if outcome.external_tokens else Fate.UNKNOWN)
        if self._dense_grid:
            self._add_dense_states()

    def _add_dense_states(self) -> None:
        """Wheels without hand-offs keep a state at every whole Mamba block a request computed."""
        block = self.geometry.mamba_block_size
        # A request that has left the scheduler has computed all it ever will.
        for rid in [r for r in self._running if r not in self.engine.scheduler.requests]:
            self._running.discard(rid)
            request = self.requests[rid]
            computed = len(request.prompt_token_ids) + request.max_tokens - 1
            for position in range(block, computed + 1, block):
                self._add_state(rid, position, Fate.UNKNOWN)

    def _add_state(self, rid: str, position: int, fate: Fate) -> None:
        if position <= 0 or position % self.unit:
            return
        keys = self.keys[rid]
        units = position // self.unit
        if units <= len(keys):
            self.grid.add(int(keys[units - 1]), fate)

    def _admission(self, rid: str, reused: int) -> Admission:
        ideal = self.ideal[rid]
        pending = self.pending.get(rid)
        if pending is None:
            # The connector was never asked: nothing observed, so nothing is explained.
            return Admission(ideal, reused, ideal, Fate.UNKNOWN, ideal, False, 0, False)
        # With the CPU tier holding a suffix, GPU prefix + CPU suffix was servable. Without, the
        # best was the GPU hit every group agreed on, which is what the scheduler then used (the
        # local hit shown to the connector may be deeper in one group only, 0.27+).
        served = pending.local + pending.beyond if pending.beyond else reused
        return Admission(
            ideal=ideal,
            reused=reused,
            grid=pending.grid_units,
            grid_fate=pending.grid_fate,
            served=served,
            misaligned=pending.local % self.engine.scheduler_block_size != 0,
            eagle_drop=self._eagle_drop(),
            cpu_evicted_before=pending.cpu_evicted_before,
        )
