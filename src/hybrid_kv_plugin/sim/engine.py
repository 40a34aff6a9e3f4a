"""``SimEngine``: the installed wheel's real scheduler, stepped without a model.

Invariant kept by :meth:`SimEngine.step`: the hand-made ``ModelRunnerOutput`` samples
exactly one token for a request whose scheduled tokens reach the end of its known
tokens (prompt complete, or a decode step), and none for a partial prefill chunk,
which is what a real model runner reports.

Two drivers, as the engine core has: ``async_scheduling=False`` schedules, executes and
delivers each step's output before the next schedule (``EngineCore.step``);
``async_scheduling=True`` builds the wheel's ``AsyncScheduler`` and plays
``EngineCore.step_with_batch_queue`` with the config's ``max_concurrent_batches``
(2): step N is executed as soon as it is scheduled, and its output is delivered
after step N+1 is scheduled, so requests carry ``num_output_placeholders``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybrid_kv_plugin.sim import wheel
from hybrid_kv_plugin.sim.byte_cache import ByteCache
from hybrid_kv_plugin.sim.geometry import DRAFT_LAYER, HybridGeometry, build_kv_cache_config, build_vllm_config

SAMPLED_TOKEN = 7
# The driver of an engine built without ``async_scheduling``: the scenario helpers build
# their own engines, so a test switches all of them at once (tests/conftest.py).
_ASYNC_BY_DEFAULT: contextvars.ContextVar[bool] = contextvars.ContextVar("hybrid_kv_sim_async", default=False)


@contextlib.contextmanager
def default_scheduling(async_scheduling: bool) -> Iterator[None]:
    """Engines built inside the block without an explicit ``async_scheduling`` get this one."""
    token = _ASYNC_BY_DEFAULT.set(async_scheduling)
    try:
        yield
    finally:
        _ASYNC_BY_DEFAULT.reset(token)


def async_by_default() -> bool:
    """The scheduler an engine built here without ``async_scheduling`` gets (see :func:`default_scheduling`)."""
    return _ASYNC_BY_DEFAULT.get()


@dataclass
class StepRecord:
    index: int
    num_scheduled_tokens: dict[str, int]
    first_scheduled: dict[str, int]  # req_id -> num_computed_tokens when it first ran (local + external hit)
    finished: list[str]  # left the scheduler in this step (under async: when an earlier step's output arrived)
    load_event: int | None = None
    store_event: int | None = None


@dataclass
class RequestOutcome:
    """Per request: the hit it got and from where. ``external`` is what the connector loaded."""

    prompt_tokens: int
    hit_tokens: int | None = None
    external_tokens: int = 0
    finished: bool = False


@dataclass
class TransferPolicy:
    """When the simulated worker reports connector transfers done (an edge, not vLLM code).

    ``delay_steps``: completions are reported that many steps after they were issued.
    """

    delay_steps: int = 0
    _pending: list[tuple[int, str, Any]] = field(default_factory=list)
    # Fault injection (None: every transfer completes after ``delay_steps``, in issue
    # order). Asked once per issued transfer as ``fate(kind, payload)``: kind "load"
    # (payload: its request ids) or "store" (payload: the store event index).
    fate: Callable[[str, Any], TransferFate] | None = None
    # Loads reported failed: (step of the report, request ids, GPU destination block ids).
    failed_loads: list[tuple[int, list[str], list[int]]] = field(default_factory=list)


@dataclass(frozen=True)
class TransferFate:
    """What the simulated worker does with one transfer it was handed.

    ``extra_delay``: steps on top of ``delay_steps`` for this transfer only, so a later
    transfer can complete first. ``fail``: a load is reported failed through the wheel's
    own channel (stores have none in vLLM: a failed copy is a worker error there).
    """

    extra_delay: int = 0
    fail: bool = False


class _LoadRequests(list):
    """The request ids of one load, carrying its event index for the byte cache."""

    event: int = -1


class SimEngine:
    def __init__(
        self,
        geometry: HybridGeometry | None = None,
        *,
        kv_connector: str | None = None,
        kv_connector_extra_config: dict[str, Any] | None = None,
        additional_config: dict[str, Any] | None = None,
        adapter: Any = None,
        transfer_policy: TransferPolicy | None = None,
        scheduler_cls: type | None = None,
        configure: Callable[[Any], None] | None = None,
        byte_check: bool | None = None,
        async_scheduling: bool | None = None,
    ):
        from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
        from vllm.v1.structured_output import StructuredOutputManager

        if adapter is None:
            from hybrid_kv_plugin.registration import current_adapter

            adapter = current_adapter()
        self.adapter = adapter
        self.geometry = geometry or HybridGeometry()
        self.vllm_config = build_vllm_config(
            self.geometry,
            adapter,
            kv_connector=kv_connector,
            kv_connector_extra_config=kv_connector_extra_config,
            additional_config=additional_config,
        )
        if configure is not None:
            # Last word on the VllmConfig before anything reads it (e.g. a DCP size or
            # KV events, which the config validators or the geometry do not cover).
            configure(self.vllm_config)
        self.kv_cache_config = build_kv_cache_config(self.geometry, adapter)
        # The wheel's engine flags EAGLE groups while grouping layers; do it its way here.
        wheel.mark_eagle_groups(adapter, self.vllm_config, self.kv_cache_config, frozenset({DRAFT_LAYER}))
        register_all_kvcache_specs(self.vllm_config)
        self.vllm_config.cache_config.num_gpu_blocks = self.geometry.num_gpu_blocks
        self.scheduler_block_size, self.hash_block_size = wheel.resolve_block_sizes(
            adapter, self.kv_cache_config, self.vllm_config
        )
        if async_scheduling is None:
            async_scheduling = _ASYNC_BY_DEFAULT.get()
        self.async_scheduling = async_scheduling
        if async_scheduling:
            # What a GPU `vllm serve` of a generative model resolves to on every supported wheel.
            self.vllm_config.scheduler_config.async_scheduling = True
        if scheduler_cls is None:
            from vllm.v1.core.sched.scheduler import Scheduler

            scheduler_cls = self.vllm_config.scheduler_config.get_scheduler_cls() if async_scheduling else Scheduler
        # Batches executed and not yet delivered, oldest first (the engine core's batch queue).
        self._in_flight: deque[tuple[Any, Any]] = deque()
        # Load failures the worker reported in an output not yet delivered, by that output's identity.
        self._undelivered_failures: dict[int, tuple[int, list[str], list[int]]] = {}
        self._queue_depth = self.vllm_config.max_concurrent_batches if async_scheduling else 1
        self.scheduler = scheduler_cls(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=self.scheduler_block_size,
            hash_block_size=self.hash_block_size,
        )
        self.block_hasher = wheel.request_block_hasher(adapter, self.vllm_config, self.hash_block_size)
        self.transfers = transfer_policy or TransferPolicy()
        self.outcomes: dict[str, RequestOutcome] = {}
        self._unfinished: set[str] = set()
        self.steps: list[StepRecord] = []
        self._observe_connector()
        # The simulated worker's cache contents (sim/byte_cache.py); None: bookkeeping only.
        if byte_check is None:
            byte_check = wheel.byte_check_models(adapter, kv_connector is not None)
        self.byte_cache: ByteCache | None = ByteCache(self, SAMPLED_TOKEN) if byte_check else None

    # ------------------------------------------------------------------ accessors
    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    @property
    def gpu_block_pool(self) -> Any:
        return self.scheduler.kv_cache_manager.block_pool

    @property
    def offload_manager(self) -> Any:
        """The SimpleCPU scheduler-side manager (``SimpleCPUOffloadScheduler``), if any."""
        return getattr(self.connector, "scheduler_manager", None)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], max_tokens: int = 1) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None,
            block_hasher=self.block_hasher,
        )
        self.outcomes[request_id] = RequestOutcome(prompt_tokens=len(prompt_token_ids))
        self._unfinished.add(request_id)
        self.scheduler.add_request(request)
        return request

    def abort(self, request_ids: Sequence[str]) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def reset_prefix_cache(self) -> bool:
        """Evict the GPU prefix cache only (the CPU tier keeps what it stored)."""
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def has_work(self) -> bool:
        return self._wants_schedule() or bool(self._in_flight)

    def _wants_schedule(self) -> bool:
        """The scheduler has requests, or the worker still owes transfer reports (a step runs it)."""
        pending_transfers = bool(self.transfers._pending)
        connector_busy = False
        if self.connector is not None and hasattr(self.connector, "has_pending_transfers"):
            connector_busy = bool(self.connector.has_pending_transfers())
        return self.scheduler.has_requests() or pending_transfers or connector_busy

    @property
    def in_flight(self) -> int:
        """Batches executed whose output the scheduler has not received yet (0 without async)."""
        return len(self._in_flight)

    @property
    def undelivered(self) -> tuple[tuple[Any, Any], ...]:
        """(scheduler output, runner output) of those batches, oldest first."""
        return tuple(self._in_flight)

    # ------------------------------------------------------------------ stepping
    def step(self) -> StepRecord:
        """One engine-core step: schedule and execute, then deliver an output if one is due."""
        record = StepRecord(index=len(self.steps), num_scheduled_tokens={}, first_scheduled={}, finished=[])
        if not self.async_scheduling:
            scheduler_output = self._schedule(record)
            self._deliver(scheduler_output, self._execute(scheduler_output, record))
        else:
            # EngineCore.step_with_batch_queue: fill the queue first; deliver the oldest
            # batch once it is full, or when this step ran nothing and nothing waits.
            if self._wants_schedule():
                scheduler_output = self._schedule(record)
                self._in_flight.append((scheduler_output, self._execute(scheduler_output, record)))
                executed = scheduler_output.total_num_scheduled_tokens > 0
                if len(self._in_flight) < self._queue_depth and (executed or self.scheduler.has_requests()):
                    self._finish_step(record)
                    return record
            if self._in_flight:
                self._deliver(*self._in_flight.popleft())
        self._finish_step(record)
        return record

    def _schedule(self, record: StepRecord) -> Any:
        scheduler_output = self.scheduler.schedule()
        record.num_scheduled_tokens = dict(scheduler_output.num_scheduled_tokens)
        for new_request in scheduler_output.scheduled_new_reqs:
            record.first_scheduled[new_request.req_id] = new_request.num_computed_tokens
            outcome = self.outcomes.get(new_request.req_id)
            if outcome is not None and outcome.hit_tokens is None:
                outcome.hit_tokens = new_request.num_computed_tokens
        return scheduler_output

    def _execute(self, scheduler_output: Any, record: StepRecord) -> Any:
        """The simulated worker runs one scheduled step, right after it was scheduled; its output."""
        from vllm.v1.outputs import ModelRunnerOutput

        if self.byte_cache is not None:
            self.byte_cache.before_forward(scheduler_output)
            self.byte_cache.forward(scheduler_output)
        req_ids, sampled = [], []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.scheduler.requests[req_id]
            req_ids.append(req_id)
            # Read right after schedule(): the computed tokens include this step's, and under
            # async the earlier steps' placeholders, so a decode always reaches the end.
            prompt_done = request.num_computed_tokens >= request.num_tokens
            sampled.append([SAMPLED_TOKEN] if prompt_done else [])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=self._worker_transfers(scheduler_output, record),
        )

    def _deliver(self, scheduler_output: Any, output: Any) -> None:
        self.scheduler.update_from_output(scheduler_output, output)
        # A failed load counts once the scheduler has received its report (under async: a step late).
        failure = self._undelivered_failures.pop(id(output.kv_connector_output), None)
        if failure is not None:
            self.transfers.failed_loads.append(failure)

    def _finish_step(self, record: StepRecord) -> None:
        # Only requests not yet finished are checked: a long trace has thousands of outcomes.
        for req_id in [r for r in self._unfinished if r not in self.scheduler.requests]:
            self._unfinished.discard(req_id)
            self.outcomes[req_id].finished = True
            record.finished.append(req_id)
        self.steps.append(record)

    def run_until_idle(self, max_steps: int = 100_000) -> list[StepRecord]:
        """Step until idle; then the byte check's violations, if any, fail the run (all named)."""
        start = len(self.steps)
        while self.has_work():
            if len(self.steps) - start >= max_steps:
                raise RuntimeError(f"scheduler did not go idle within {max_steps} steps")
            self.step()
        if self.byte_cache is not None:
            self.byte_cache.check()
        return self.steps[start:]

    def run(self, requests: Sequence[tuple[str, Sequence[int]]], max_tokens: int = 1) -> dict[str, int]:
        """Add requests, run to idle, return each one's hit (tokens it did not compute)."""
        for request_id, tokens in requests:
            self.add_request(request_id, tokens, max_tokens=max_tokens)
        self.run_until_idle()
        return {request_id: self.outcomes[request_id].hit_tokens or 0 for request_id, _ in requests}

    # ------------------------------------------------------------------ the simulated worker (an edge)
    def _worker_transfers(self, scheduler_output: Any, record: StepRecord) -> Any:
        from vllm.v1.outputs import KVConnectorOutput

        meta = scheduler_output.kv_connector_metadata
        if meta is None or self.connector is None:
            return None
        from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

        step = len(self.steps)
        byte_cache = self.byte_cache
        if getattr(meta, "load_event", -1) >= 0:
            record.load_event = meta.load_event
            reqs = _LoadRequests(meta.load_event_to_reqs.get(meta.load_event, []))
            reqs.event = meta.load_event
            if byte_cache is not None:
                byte_cache.issue("load", meta.load_event, meta, reqs)
            self.transfers._pending.append(self._issue(step, "load", reqs, meta))
        if getattr(meta, "store_event", -1) >= 0:
            record.store_event = meta.store_event
            if byte_cache is not None:
                byte_cache.issue("store", meta.store_event, meta)
            self.transfers._pending.append(self._issue(step, "store", meta.store_event, meta))
        due = [p for p in self.transfers._pending if p[0] <= step]
        self.transfers._pending = [p for p in self.transfers._pending if p[0] > step]
        if byte_cache is not None:
            # The bytes land when the worker reports the transfer done (a flush moved them earlier).
            for _, kind, payload in due:
                if kind == "store":
                    byte_cache.complete(("store", payload))
                else:
                    reqs = payload if kind == "load" else payload[0]
                    byte_cache.complete(("load", reqs.event), failed=kind == "failed_load")
        recving = {r for _, kind, reqs in due if kind == "load" for r in reqs}
        stores = {event: 1 for _, kind, event in due if kind == "store"}
        output = KVConnectorOutput(
            finished_recving=recving or None,
            kv_connector_worker_meta=SimpleCPUOffloadWorkerMetadata(completed_store_events=stores),
        )
        failed = [payload for _, kind, payload in due if kind == "failed_load"]
        if failed:
            self._report_failed_loads(output, failed, step)
        return output

    def _issue(self, step: int, kind: str, payload: Any, meta: Any) -> tuple[int, str, Any]:
        """The pending entry of one transfer: when it completes, and whether it fails."""
        due = step + self.transfers.delay_steps
        if self.transfers.fate is None:
            return due, kind, payload
        fate = self.transfers.fate(kind, payload)
        if fate.fail and kind == "load":
            return due + fate.extra_delay, "failed_load", (payload, list(meta.load_gpu_blocks))
        return due + fate.extra_delay, kind, payload

    def _report_failed_loads(self, output: Any, failed: list[tuple[list[str], list[int]]], step: int) -> None:
        """Report loads as done but failed, the way the wheel's scheduler expects a connector to.

        The request ids are in ``finished_recving`` (the transfer is over) and in the
        wheel's failure channel: per request where it has one, else the destination
        blocks as ``invalid_block_ids`` - which the older schedulers map back to requests
        through exactly one KV-cache group.
        """
        req_ids = [req_id for reqs, _ in failed for req_id in reqs]
        gpu_ids = sorted({block_id for _, blocks in failed for block_id in blocks})
        output.finished_recving = set(output.finished_recving or ()) | set(req_ids)
        if self.adapter.kv_load_failure_by_request:
            output.failed_recving = set(req_ids)
        elif len(self.kv_cache_config.kv_cache_groups) == 1:
            output.invalid_block_ids = set(gpu_ids)
        else:
            raise NotImplementedError(
                f"vLLM {self.adapter.version} takes load failures only as invalid_block_ids, which its "
                f"scheduler maps to one KV-cache group; this geometry has "
                f"{len(self.kv_cache_config.kv_cache_groups)}"
            )
        self._undelivered_failures[id(output)] = (step, req_ids, gpu_ids)

    def _observe_connector(self) -> None:
        """Record each request's external (connector) hit; the connector's answer is unchanged."""
        connector = self.connector
        if connector is None:
            return
        original: Callable[..., Any] = connector.get_num_new_matched_tokens
        outcomes = self.outcomes

        def get_num_new_matched_tokens(request: Any, num_computed_tokens: int) -> Any:
            result = original(request, num_computed_tokens)
            external = result[0] if isinstance(result, tuple) else result
            if request.request_id in outcomes and external:
                outcomes[request.request_id].external_tokens = external
            return result

        connector.get_num_new_matched_tokens = get_num_new_matched_tokens
