"""The adapter interface: every fact about a vLLM wheel that feature code needs.

Feature code never compares versions; it asks the selected adapter. Each family
module (``vllm_0_26`` ... ``vllm_0_33``) subclasses the previous family and
overrides only what changed, so a difference between two wheels is one line in
one file. Which patches a wheel gets is not decided here: the manifest in
:mod:`hybrid_kv_plugin.patches` reads these facts.
"""

from __future__ import annotations

from typing import Any, ClassVar

from hybrid_kv_plugin.adapters.capabilities import Feature, FeatureVerdict, Support



class VllmAdapter:
    # The (major, minor) families this adapter serves and the wheels it was tested on.
    families: ClassVar[tuple[tuple[int, int], ...]] = ()
    tested_wheels: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def probe(cls) -> bool:
        """Whether an installed vLLM whose version string says nothing has what this family introduced.

        Each family defines its own (``adapters.probes`` helpers); ``detect.probe_family`` asks the
        newest family first, so a probe need not exclude newer families."""
        return False

    # --- facts about the wheel (override in the family that changed them) ---
    # KVCacheTensor layout: "shared_by" (<=0.28) or "layers" (0.29+).
    kv_cache_tensor_style: ClassVar[str] = "shared_by"
    # Where the coordinator reads the prefix-cache retention interval: this environment
    # variable (<=0.28) or, when None, KVCacheConfig.prefix_cache_retention_interval (0.29+).
    retention_interval_env_var: ClassVar[str | None] = "VLLM_PREFIX_CACHE_RETENTION_INTERVAL"
    # The engine runs a hybrid align model with CacheConfig.block_size equal to the Mamba
    # block size (<=0.27: hash-size resolution compares Mamba blocks against it).
    cache_block_size_is_mamba_block_size: ClassVar[bool] = True
    # Request hashes include speculative lookahead tokens (0.33+).
    hashes_lookahead_tokens: ClassVar[bool] = False
    # Under EAGLE block drop the engine flags exactly the KV-cache groups holding a draft
    # layer as EAGLE groups (0.33+); older wheels flag none for plain EAGLE.
    eagle_groups_follow_draft_layers: ClassVar[bool] = False
    # KVCacheConfig carries hash_block_size / cache_hit_alignment_tokens (0.33+).
    kv_cache_config_carries_hash_sizes: ClassVar[bool] = False
    # The native CacheConfig field of the junction checkpoint, if the wheel has one.
    native_junction_flag: ClassVar[str | None] = None
    # Junction checkpoint. The Scheduler attribute holding the native gate (0.30+); the
    # KVCacheManager holds it under the same name.
    native_junction_scheduler_attr: ClassVar[str | None] = None
    # The MambaManager attribute the KVCacheManager sets when the native gate opens (0.30+).
    native_junction_manager_attr: ClassVar[str | None] = None
    # mamba_divergence_checkpoint (hybrid_kv_plugin.divergence): the junction checkpoint's stop and
    # kept state without the EAGLE gate. Built on the 0.29 junction backport or the native gate
    # (0.30+), and on the wheel's own Mamba boundary hand-offs to reach the CPU tier (0.29+).
    divergence_checkpoint_supported: ClassVar[bool] = False
    # The Scheduler's EAGLE block-drop bit (0.30 split it from ``use_eagle``).
    scheduler_eagle_drop_attr: ClassVar[str] = "use_eagle"
    # Exactly the ``self.`` attributes the stock Scheduler._mamba_block_aligned_split reads (the
    # fingerprint of every patch that adds a stop to it: chunk_stop.stock_split_fingerprint).
    mamba_split_reads: ClassVar[frozenset[str]] = frozenset(
        {"cache_config", "hash_block_size", "mamba_partial_cache_hit", "use_eagle"}
    )
    # Exactly the ``self.`` attributes the stock MambaManager._cache_partial_tail_block touches,
    # and whether it records the request as the producer of its partial state (0.27+).
    mamba_partial_tail_reads: ClassVar[frozenset[str]] = frozenset(
        {"_partial_hit_reqs", "block_pool", "block_size", "kv_cache_group_id", "num_cached_block", "req_to_blocks"}
    )
    mamba_tracks_partial_tail_producers: ClassVar[bool] = False
    # KVCacheManager._partial_tail_pins holds one reference on each producer's prompt-tail
    # copy until the request's blocks are freed (0.27-0.28; 0.29 dropped that channel).
    kv_cache_manager_pins_partial_tails: ClassVar[bool] = False
    # Coordinator attributes the junction gate needs beyond those of every wheel.
    junction_coordinator_extra_attrs: ClassVar[tuple[str, ...]] = ()
    # scheduler_output.kv_connector_block_state.boundary_state_offloads exists (0.29+).
    has_boundary_handoffs: ClassVar[bool] = False
    # The plugin adds that channel (patches mamba_boundary_handoffs + boundary_handoff_publish):
    # 0.26-0.28, whose Mamba managers record no boundary states.
    boundary_handoff_patch_needed: ClassVar[bool] = False
    # The scheduler trims a local hit for a longer external one with a truncate that asserts
    # every group covers the prefix, Mamba included (0.27 only; patch truncate_mamba_lookup).
    mamba_lookup_trim_patch_needed: ClassVar[bool] = False
    # With a KV connector on a hybrid model the scheduler takes the deepest group's local
    # hit, whose boundary a lagging group holds no data for (0.26; patch connector_hit_reconcile).
    connector_lookup_takes_deepest_group: ClassVar[bool] = False
    # The align-mode Mamba manager marks a request allocated even when a call needs no new
    # block (0.28+); older wheels mark only calls that allocate (patch mamba_allocated_mark).
    mamba_marks_requests_allocating_nothing: ClassVar[bool] = True
    # The align-mode Mamba manager counts a running chunk's new blocks no higher than it
    # allocates (0.31+). Older wheels count one more for a chunk that resumes from a state inside
    # a block; under AsyncScheduler, whose Mamba manager frees the previous state's block a step
    # later, a request that needs the whole pool is then preempted at that chunk for ever.
    mamba_chunk_count_capped: ClassVar[bool] = False
    has_native_fine_grained_cpu_hits: ClassVar[bool] = False
    # The stock SimpleCPU scheduler stores align Mamba blocks by walking the block table it
    # accumulated, which keeps blocks the request has handed on (0.26-0.29; 0.30+ takes them
    # from the boundary hand-offs; patch stock_store_skips_handed_on_mamba).
    simplecpu_scans_mamba_positionally: ClassVar[bool] = True
    # The align-mode split keeps chunk ends on the Mamba block grid only below the last position a
    # hit resumes from, which EAGLE lowers a block (0.26; patch mamba_split_keeps_block_grid).
    mamba_split_aligns_below_cache_limit_only: ClassVar[bool] = False
    has_native_nixl_ssm_clip: ClassVar[bool] = False
    # NixlBaseConnectorWorker._apply_prefix_caching takes (decode ids, prefill ids) then one
    # physical-per-logical ratio (<=0.27: the remote's) or two (0.28+: decode's, prefill's).
    nixl_pairing_ratio_args: ClassVar[int] = 1
    # Keys the wheel's stock SimpleCPUOffloadConnector reads from kv_connector_extra_config.
    simplecpu_stock_keys: ClassVar[frozenset[str]] = frozenset(
        {"cpu_bytes_to_use", "cpu_bytes_to_use_per_rank", "lazy_offload"}
    )
    # Fine-grained CPU offload hits. The worker submits a step's stores even when the
    # step runs no forward pass (0.26-0.28 from get_finished, 0.30+ natively); the 0.29
    # worker submits only from wait_for_save.
    simplecpu_worker_submits_without_forward: ClassVar[bool] = False
    # The SimpleCPU scheduler method that registers copied blocks in the CPU pool under their
    # hashes, (gpu_block_ids, cpu_block_ids, ...); the Mooncake store tier writes after it (0.26-0.33).
    simplecpu_store_completion_hook: ClassVar[str] = "_process_store_completion"
    # vllm/v1/simple_kv_offload/metrics.py exports the store outcomes to Prometheus (0.31+).
    has_native_simplecpu_metrics: ClassVar[bool] = False
    # The SimpleCPU scheduler side's method that picks a finished request's attention partial
    # tail (request, block_ids) -> block or None, wrapped by cpu_tier_request_ends on 0.30+ (the
    # backport up to 0.29 offers its own hook, partial_tail_filter).
    simplecpu_partial_tail_finder: ClassVar[str] = "_attention_partial_tail"
    # The engine core asks workers for the aligned CPU block count only when a connector
    # *named* SimpleCPUOffloadConnector is configured (0.33+, v1/engine/core.py).
    simplecpu_block_count_gated_by_name: ClassVar[bool] = False
    # A connector can report a failed load per request (KVConnectorOutput.failed_recving,
    # 0.30+). Older wheels only take invalid_block_ids, which their scheduler maps back to
    # requests through a single KV-cache group: a hybrid model's failed load cannot be told.
    kv_load_failure_by_request: ClassVar[bool] = False
    # A failed async KV load can leave a stale in-flight reservation (0.29+; 0.26-0.28 reserve
    # for async loads too but run 0.29's deadlocking program to idle); the waiting scan reads
    # this FCFS queue first. None: no failed-load liveness patch (async_load_liveness).
    first_waiting_queue_attr: ClassVar[str | None] = None

    # prompt_tail_checkpoint (hybrid_kv_plugin.prompt_tail): values other than "native" are
    # offered (0.29+); where the wheel keeps the prompt-tail Mamba state natively: at the
    # last hash boundary <= N-1 (0.32+) or at the prompt's last one (0.29-0.31), the latter
    # one unit lower under EAGLE block drop (0.30+); whether the manager records a partial-tail
    # producer as (block, tokens) (0.30+) or as tokens.
    prompt_tail_checkpoint_supported: ClassVar[bool] = False
    native_prompt_tail_keeps_replay_position: ClassVar[bool] = False
    native_prompt_tail_eagle_shift: ClassVar[bool] = False
    mamba_partial_tail_producer_holds_block: ClassVar[bool] = False
    # The native prompt-tail state sits at the prompt's last boundary, which under AsyncScheduler is
    # offered to the Mamba manager again after the first decode was scheduled (0.26-0.31; patch
    # prompt_tail_keyed_once).
    native_prompt_tail_keyed_after_its_chunk: ClassVar[bool] = True
    # Under sparse prefix-cache retention the Mamba manager keeps a full block's state only at
    # the positions its ``cache_blocks`` receives as ``replay_boundaries`` (0.30+); the
    # prompt_tail_retention patch adds the kept prompt-tail positions there.
    mamba_retention_keeps_replay_boundaries: ClassVar[bool] = False
    # The Mamba manager's own constructor sets more attributes than CPython 3.11 keeps inline
    # (0.30+: tests/test_inert_patches.py probes it on every wheel), so binding a method on
    # one moves nothing off the fast path (hybrid_kv_plugin.inert_patches).
    mamba_manager_attributes_past_inline: ClassVar[bool] = False
    # mamba_output_checkpoint (hybrid_kv_plugin.output_checkpoint): built on the wheel's own Mamba
    # boundary hand-off channel (0.29+). 0.26-0.28 run the plugin's replacement channel
    # (patch mamba_boundary_handoffs), which the feature does not cover yet: refused there.
    output_checkpoint_supported: ClassVar[bool] = False
    # The in-process LLMEngine.step() records scheduler stats only on steps with request outputs
    # (0.26-0.27; vLLM #48668, 0.28, records every step): patch step_stats_without_outputs.
    llm_engine_drops_stats_without_outputs: ClassVar[bool] = False

    # Backports this plugin release ships; a feature missing from here is "unavailable".
    backports_shipped: ClassVar[frozenset[Feature]] = frozenset()

    def __init__(self, version: str):
        self.version = version

    @property
    def name(self) -> str:
        first, last = self.families[0], self.families[-1]
        span = f"{first[0]}.{first[1]}" + ("" if first == last else f"-{last[0]}.{last[1]}")
        return f"vllm {span} adapter"

    # ------------------------------------------------------------------ capabilities
    def verdicts(self) -> list[FeatureVerdict]:
        return [self.verdict(feature) for feature in Feature]

    def verdict(self, feature: Feature) -> FeatureVerdict:
        native, why_not = self._native_or_missing(feature)
        if native:
            return FeatureVerdict(feature, Support.NATIVE, why_not)
        if feature in self.backports_shipped:
            return FeatureVerdict(feature, Support.BACKPORT, why_not)
        return FeatureVerdict(feature, Support.UNAVAILABLE, self._unavailable_reason(feature, why_not))

    def _native_or_missing(self, feature: Feature) -> tuple[bool, str]:
        if feature is Feature.NIXL_SSM_SLOT_PAIRING:
            if self.has_native_nixl_ssm_clip:
                return True, "the NIXL scheduler has get_exchange_clipped_blocks (vLLM 0.27.0)"
            return False, "the NIXL scheduler clips sliding-window groups only"
        if feature is Feature.MAMBA_SHARED_PREFIX_CHECKPOINT:
            if self.native_junction_flag:
                return True, f"CacheConfig.{self.native_junction_flag} (vLLM PR #53945)"
            return False, "the Mamba split stops at the block-floored junction only"
        if self.has_native_fine_grained_cpu_hits:
            return True, "SimpleCPU loads fine-grained hybrid hits (vLLM PR #54736)"
        if self.has_boundary_handoffs:
            return False, "SimpleCPU ignores the Mamba boundary handoffs this wheel publishes"
        if self.boundary_handoff_patch_needed:
            return False, "this wheel publishes no Mamba boundary handoffs (the plugin adds the vLLM 0.29 channel)"
        return False, "this wheel publishes no Mamba boundary handoffs (needs vLLM >= 0.29.0)"

    def _unavailable_reason(self, feature: Feature, why_not: str) -> str:
        if feature is Feature.FINE_GRAINED_CPU_HITS and not self.has_boundary_handoffs:
            return f"{why_not}; the connector refuses fine-grained mode at start-up"
        return f"{why_not}; this plugin release ships no backport for this wheel"

    def supports(self, feature: Feature) -> bool:
        return self.verdict(feature).support is not Support.UNAVAILABLE

    def installs_backport(self, feature: Feature) -> bool:
        """Whether the plugin's backport of ``feature`` goes into this wheel: shipped, and not native."""
        return self.verdict(feature).support is Support.BACKPORT

    # ------------------------------------------------------------------ runtime facts
    def coordinator_reprefillable_tokens(self, coordinator: Any) -> int:
        """Tokens a multi-module MTP drafter may re-prefill, which the coordinator leaves uncached.

        0.26-0.27 know no such tail (their coordinators cache the chunk end)."""
        return 0

    def mamba_exports_checkpoint(self, manager: Any, request_id: str) -> bool:
        """Whether the backend exports this request's prefill checkpoint inside a chunk (0.30+)."""
        return False

    def request_holds_kv_blocks(self, scheduler: Any, request_id: str) -> bool:
        """Whether the KV cache manager holds a real (non-null) block for the request, in any group."""
        managers = scheduler.kv_cache_manager.coordinator.single_type_managers
        return any(not block.is_null for manager in managers for block in manager.req_to_blocks.get(request_id, ()))

    def offload_gpu_block_pool(self, scheduler_manager: Any) -> Any:
        """The GPU ``BlockPool`` the SimpleCPU scheduler side stores from (set at its first step).

        Every wheel's scheduler side (and the 0.29 backport) keeps it as ``_gpu_block_pool``."""
        return scheduler_manager._gpu_block_pool

    def release_declined_cpu_hit(self, scheduler_manager: Any, request_id: str) -> bool:
        """Unpin the CPU-tier hit the lookup recorded for a request the scheduler granted no external tokens.

        Every wheel's SimpleCPU scheduler pins a lookup's CPU blocks until allocation
        (``_pending_cpu_hits``) and, handed 0 external tokens, releases them with a
        warning it calls unexpected. The scheduler declines a CPU hit on purpose when a
        local sub-block tail reaches as far (0.27+), for ``skip_reading_prefix_cache``
        and for a bounded replay window. Returns whether a pin was released.
        """
        pending = scheduler_manager._pending_cpu_hits.pop(request_id, None)
        if pending is None:
            return False
        scheduler_manager._free_pending_cpu_hit(pending)
        return True

    def scheduler_eagle_drop(self, vllm_config: Any) -> bool:
        """What the Scheduler built from ``vllm_config`` sets ``scheduler_eagle_drop_attr`` to (prefix
        hits drop their last matched unit for the drafter), for code that never sees that Scheduler
        (the SimpleCPU connector's scheduler side): up to 0.29, any EAGLE-family drafter."""
        speculative_config = vllm_config.speculative_config
        return speculative_config is not None and bool(speculative_config.use_eagle())

    def cpu_tier_lookup_drops_unit(self, vllm_config: Any) -> bool:
        """Whether the SimpleCPU scheduler side's own coordinator, built from ``vllm_config``, drops a
        CPU-tier hit's last matched unit for the drafter: a hit through an attention block keyed at
        position p then resumes at p - unit. 0.26 builds it with ``use_eagle=False``: never."""
        return False

    def reads_next_free_block(self, block_pool: Any) -> bool:
        """Whether ``next_free_block`` can answer for this pool: its free queue keeps a sentinel
        head (every wheel 0.26-0.33 does)."""
        return hasattr(getattr(block_pool, "free_block_queue", None), "fake_free_list_head")

    def next_free_block(self, block_pool: Any) -> Any:
        """The block ``block_pool`` hands out next, without taking it (None: no free block).

        Never-used blocks start at the head of the free queue and a freed block holding a cached
        copy joins its tail, so the head holds no cached copy until the pool first evicts one. The
        queue's sentinels have block id -1."""
        head = block_pool.free_block_queue.fake_free_list_head.next_free_block
        return None if head is None or head.block_id < 0 else head

    def free_blocks_at_head(self, block_pool: Any, limit: int) -> list[Any]:
        """The next ``limit`` blocks (fewer where fewer are free) ``block_pool`` hands out, in the
        order it takes them, without taking them (the hybrid CPU-tier order reads which copies an
        allocation evicts)."""
        blocks: list[Any] = []
        block = self.next_free_block(block_pool)
        while block is not None and block.block_id >= 0 and len(blocks) < limit:
            blocks.append(block)
            block = block.next_free_block
        return blocks

    # ------------------------------------------------------------------ SimpleCPU offload geometry
    def offload_group_block_sizes(self, coordinator: Any) -> tuple[int, ...]:
        """Physical block size of each KV-cache group, as the coordinator's managers resolved it.

        The managers already apply DCP only to the groups it shards (full attention);
        0.30+ publishes the same tuple as ``coordinator.group_block_sizes``.
        """
        return tuple(manager.block_size for manager in coordinator.single_type_managers)

    def offload_positionally_stable(self, manager: Any) -> bool:
        """Whether a monotonically advancing cursor can follow this manager's block table.

        Mamba in ``align`` mode nulls interior states and relocates speculative blocks in
        place, so its blocks must come from the boundary hand-offs instead (0.30+ exposes
        this as ``manager.has_positionally_stable_blocks``).
        """
        from vllm.v1.core.single_type_kv_cache_manager import MambaManager

        return not (isinstance(manager, MambaManager) and manager.mamba_cache_mode == "align")

    # ------------------------------------------------------------------ plugin config
    def apply_native_flags(self, vllm_config: Any, plugin_config: Any) -> None:
        """Map plugin switches onto the wheel's native fields, where it has them."""
        flag = self.native_junction_flag
        if flag and plugin_config.mamba_shared_prefix_checkpoint:
            setattr(vllm_config.cache_config, flag, True)

    def native_junction_flag_set(self, vllm_config: Any) -> bool:
        flag = self.native_junction_flag
        return bool(flag and getattr(vllm_config.cache_config, flag, False))
