"""The connector users name in ``--kv-transfer-config``: ``HybridSimpleCPUConnector``.

It is the wheel's own ``SimpleCPUOffloadConnector`` plus what the plugin offers on
every wheel: validated options (``kv_connector_extra_config``), the fine-grained
hybrid hit behaviour of vLLM PR #54736 (native on 0.30+, backported on 0.29,
refused with one message on 0.26-0.28 unless ``"fine_grained_hits": false``),
``get_boundary_store_stats()`` with the same fields everywhere, and the
``vllm:simple_kv_offload_save_outcomes_total`` Prometheus series on wheels that
do not export it (0.29, 0.30). Being a subclass, it inherits ``SupportsHMA``,
which vLLM requires of any connector used with the hybrid KV-cache manager.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
    SimpleCPUOffloadConnector,
)

from hybrid_kv_plugin.attention_partial_block import attention_tail_boundary
from hybrid_kv_plugin.config import connector_options_from, plugin_config_from
from hybrid_kv_plugin.offload.admission import attach_request_end_admission, check_cpu_tier_request_ends
from hybrid_kv_plugin.offload.eviction import attach_cpu_tier_policy, check_cpu_tier_eviction
from hybrid_kv_plugin.offload.metrics import OffloadOutcomePromMetrics, OffloadOutcomeStats
from hybrid_kv_plugin.offload.mode import OffloadMode, choose_mode
from hybrid_kv_plugin.offload.stats import OUTCOME_LABELS, BoundaryStoreStats
from hybrid_kv_plugin.prompt_tail.policy import NATIVE as NATIVE_PROMPT_TAIL
from hybrid_kv_plugin.registration import current_adapter


class HybridSimpleCPUConnector(SimpleCPUOffloadConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        adapter = current_adapter()
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.hybrid_kv_options = connector_options_from(extra, adapter.simplecpu_stock_keys)
        self.hybrid_kv_adapter = adapter
        # Raises (one message naming the wheel it needs) before anything is allocated.
        self.offload_mode = choose_mode(adapter, self.hybrid_kv_options, vllm_config, kv_cache_config)
        check_cpu_tier_eviction(self.hybrid_kv_options.cpu_tier_eviction, self.offload_mode, adapter)
        check_cpu_tier_request_ends(self.hybrid_kv_options.cpu_tier_request_ends, self.offload_mode, adapter)
        # Worker side on wheels whose runner skips wait_for_save() on steps without a
        # forward pass: stores queued when a request finished would never be sent.
        self._submit_on_clear = (
            self.offload_mode is OffloadMode.BACKPORT and not adapter.simplecpu_worker_submits_without_forward
        )
        self._stores_submitted = True
        self._outcomes_reported = dict(BoundaryStoreStats().__dict__)  # the counters last reported
        self._outcomes_source: BoundaryStoreStats | None = None  # the live counters last compared
        self._native_metrics = adapter.has_native_simplecpu_metrics
        # The backport's scheduler side (scheduler role on 0.29), which counts its own growth.
        self._backport_scheduler: Any = None
        super().__init__(vllm_config, role, kv_cache_config)
        if self.offload_mode is OffloadMode.BACKPORT and self.scheduler_manager is not None:
            from hybrid_kv_plugin.offload.fine_grained_scheduler import FineGrainedOffloadScheduler

            self.scheduler_manager = FineGrainedOffloadScheduler.adopt(self.scheduler_manager, adapter)
            self._backport_scheduler = self.scheduler_manager
        # Under EAGLE block drop the prompt's tail state sits one unit lower, and a CPU-tier hit
        # resumes one unit below its last attention block; each where this wheel does so.
        tail_drop = _prompt_tail_drops_unit(adapter, vllm_config)
        # The CPU tier's eviction order (offload/eviction.py); None: the wheel's LRU.
        self.cpu_tier_policy = attach_cpu_tier_policy(self, tail_drop)
        # Which request-end states the CPU tier declines (offload/admission.py); None: it takes all.
        self.request_end_admission = attach_request_end_admission(
            self, kv_cache_config, attention_tail_boundary, tail_drop, adapter.cpu_tier_lookup_drops_unit(vllm_config)
        )
        # Set by the divergence option's binding (divergence/cpu_tier.py); None: not tracked.
        self.cpu_tier_reach: Any = None
        if self._native_metrics:
            # Asked every step, and the wheel's own answer is the whole answer (0.31+).
            self.get_kv_connector_stats = super().get_kv_connector_stats  # type: ignore[method-assign]

    def track_cpu_tier_divergence(self) -> None:
        """Let CPU-tier lookups set a request's divergence point (``mamba_divergence_checkpoint``)."""
        if self.cpu_tier_reach is None and self.offload_mode is not OffloadMode.STOCK:
            from hybrid_kv_plugin.divergence.cpu_tier import attach_cpu_tier_reach

            self.cpu_tier_reach = attach_cpu_tier_reach(self)

    # ------------------------------------------------------------------ worker side
    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._stores_submitted = False

    def wait_for_save(self) -> None:
        super().wait_for_save()
        self._stores_submitted = True

    def clear_connector_metadata(self) -> None:
        if self._submit_on_clear and not self._stores_submitted and self.worker_handler is not None:
            # A step without a forward pass binds metadata and clears it without ever
            # calling wait_for_save(); submit its stores here (vLLM 0.30 does the same
            # inside its worker).
            super().wait_for_save()
        self._stores_submitted = True
        super().clear_connector_metadata()

    # ------------------------------------------------------------------ scheduler side
    def reset_cache(self) -> Any:
        done = super().reset_cache()
        if done and self.cpu_tier_policy is not None:
            self.cpu_tier_policy.cache_reset()  # its record of evictions must not outlive the copies
        return done

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        policy = self.cpu_tier_policy
        if policy is None:
            return self._matched_tokens(request, num_computed_tokens)
        policy.judge_lookup(request.request_id)
        try:
            return self._matched_tokens(request, num_computed_tokens)
        finally:
            policy.judge_lookup(None)  # a lookup the wheel skipped must not judge a later one

    def _matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        reach = self.cpu_tier_reach
        if reach is None:
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        reach.begin()
        result = super().get_num_new_matched_tokens(request, num_computed_tokens)
        reach.apply(request, num_computed_tokens)
        return result

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        admission = self.request_end_admission
        if admission is not None:
            # First: the eviction order must not see a declined state as a request's deepest.
            admission.filter_step(scheduler_output)
        if self.cpu_tier_policy is not None:
            gpu_pool = self.hybrid_kv_adapter.offload_gpu_block_pool(self.scheduler_manager)
            self.cpu_tier_policy.observe_step(scheduler_output, gpu_pool)
        return super().build_connector_meta(scheduler_output)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        manager = self.scheduler_manager
        if num_external_tokens == 0 and manager is not None and request.request_id in manager._pending_cpu_hits:
            # The scheduler kept a local hit at least as long (a sub-block tail: the plugin's
            # divergence and answer states make these common) and declined the CPU hit the
            # lookup pinned; the wheel would unpin it with a warning per request. (Most
            # requests pinned nothing: tested here, once per allocation.)
            self.hybrid_kv_adapter.release_declined_cpu_hit(manager, request.request_id)
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while queued or in-flight stores remain (0.30+ does so natively)."""
        if self.offload_mode is OffloadMode.BACKPORT and self.scheduler_manager is not None:
            return bool(self.scheduler_manager.has_pending_stores())
        return bool(super().has_pending_push_work())

    def get_boundary_store_stats(self) -> BoundaryStoreStats:
        """Cumulative Mamba boundary-store outcomes (zeros where nothing consumes the hand-offs)."""
        manager = getattr(self, "scheduler_manager", None)
        if manager is None:
            return BoundaryStoreStats()
        if self.offload_mode is OffloadMode.BACKPORT:
            return manager.get_boundary_store_stats()
        if self.offload_mode is OffloadMode.NATIVE:
            return self._with_declined_ends(BoundaryStoreStats.from_native(super().get_boundary_store_stats()))
        return BoundaryStoreStats()

    def _with_declined_ends(self, stats: BoundaryStoreStats) -> BoundaryStoreStats:
        """``stats`` (the wheel's own, 0.30+) plus the hand-offs ``cpu_tier_request_ends`` kept from it."""
        if self.request_end_admission is not None:
            declined = self.request_end_admission.declined_since_reset()
            stats.declined_request_end += declined
            stats.published += declined
        return stats

    def _outcome_growth(self) -> dict[str, int]:
        """Per outcome label, how much the wheel's native counters (0.30) grew since the last report.

        Only those that grew; the backport hands over its own growth instead (see
        :meth:`get_kv_connector_stats`).
        """
        if self.offload_mode is OffloadMode.STOCK:
            return {}  # nothing consumes the hand-offs: every counter stays 0
        # Read every step: compare the live counters first, and snapshot only when they moved.
        live = getattr(getattr(self, "scheduler_manager", None), "boundary_store_stats", None)
        if live is None:
            now = self.get_boundary_store_stats().__dict__
        else:
            # Counters only grow and ``published`` moves with each of them, so the same
            # object with the same total has not moved (a reset replaces the object).
            admission = self.request_end_admission
            published = live.published + (admission.declined_since_reset() if admission is not None else 0)
            if live is self._outcomes_source and published == self._outcomes_reported["published"]:
                return {}
            self._outcomes_source = live
            now = self._with_declined_ends(BoundaryStoreStats.from_native(live)).__dict__
        reported = self._outcomes_reported
        if now == reported:
            return {}
        self._outcomes_reported = dict(now)
        return {label: now[label] - reported[label] for label in OUTCOME_LABELS if now[label] > reported[label]}

    def get_kv_connector_stats(self) -> Any:
        if self._native_metrics:  # bound past in __init__; kept for a call through the class
            return super().get_kv_connector_stats()
        backport = self._backport_scheduler
        if backport is not None:
            # Called every step: take the growth the backport counted, no diffing.
            growth = backport.unreported_outcomes
            if not growth:
                return None
            backport.unreported_outcomes = {}
            return OffloadOutcomeStats(data=growth)
        growth = self._outcome_growth()
        return OffloadOutcomeStats(data=growth) if growth else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        if current_adapter().has_native_simplecpu_metrics:
            return super().build_kv_connector_stats(data)
        return OffloadOutcomeStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, *args: Any, **kwargs: Any) -> Any:
        """(vllm_config, metric_types, labelnames, per_engine_labelvalues), as vLLM passes them."""
        if current_adapter().has_native_simplecpu_metrics:
            return super().build_prom_metrics(*args, **kwargs)
        return OffloadOutcomePromMetrics(*args, **kwargs)


def _prompt_tail_drops_unit(adapter: Any, vllm_config: Any) -> bool:
    """Whether the engine keeps a prompt's tail Mamba state one unit lower: under the scheduler's
    EAGLE block drop, where the wheel moves its own tail state (0.30+) or ``prompt_tail_checkpoint``
    places it (0.29+; 0.26-0.28 refuse every value but ``native``)."""
    if not adapter.scheduler_eagle_drop(vllm_config):
        return False
    if adapter.native_prompt_tail_eagle_shift:
        return True
    mode = plugin_config_from(getattr(vllm_config, "additional_config", None)).prompt_tail_checkpoint
    return mode != NATIVE_PROMPT_TAIL
