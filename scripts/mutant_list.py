"""The named mutants of ``scripts/mutants``: semantic bugs the test suite must catch.

Each mutant replaces one anchor (a snippet that must occur exactly once in its file
under ``src/hybrid_kv_plugin/``) and names the smallest set of tests that kills it
and the wheels it concerns (the code it breaks runs there). To add one: append a
``Mutant``; ``tests/test_mutant_list.py`` checks every anchor against the current
source, so a refactor cannot silently disable a mutant.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to src/hybrid_kv_plugin/
    anchor: str  # occurs exactly once in the file
    replacement: str
    tests: tuple[str, ...]  # pytest node ids; at least one must fail
    wheels: tuple[str, ...]  # the .venvs/vllm-<wheel> environments to run them in
    env: tuple[tuple[str, str], ...] = ()  # extra environment of the pytest run


# The randomized suite's CI budget without hypothesis shrinking: a killed mutant fails fast.
NO_SHRINK = (("HYBRID_KV_RELIABILITY_PROFILE", "reliability-ci-noshrink"),)


FINE = "offload/fine_grained_scheduler.py"  # the 0.26-0.29 backport of fine-grained CPU hits
CHECKERS = "tests/test_invariant_checkers.py"
OFFLOAD = "tests/test_cpu_offload_behaviour.py"
JUNCTION_OUTSIDE = "tests/test_shared_prefix_checkpoint.py::test_junction_outside_the_prompt_chunk_adds_nothing"

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "landing-reservation-ignores-the-switch",
        "patches/async_load_landing_reservation.py",
        "        if not keeps_async_loads_live(self):\n",
        # The load-landing count stays on with async_load_liveness off.
        "        if False:\n",
        ("tests/test_reliability_regressions.py::test_load_landing_inside_a_mamba_block_reserves_its_copy",),
        ("0.33.0",),
    ),
    Mutant(
        "liveness-bound-past-with-the-switch-on",
        "patches/async_load_liveness.py",
        "        inert_for=lambda scheduler, _: not keeps_async_loads_live(scheduler),\n",
        # Every scheduler bound past the async-load liveness fix, with its switch on too.
        "        inert_for=lambda scheduler, _: True,\n",
        ("tests/test_inert_patches.py::test_liveness_switch_is_read_at_start_up",),
        ("0.33.0",),
    ),
    Mutant(
        "full-block-marks-bound-past-everywhere",
        "patches/local_hit_admission.py",
        "            inert_for=lambda _, scheduler: not groups_hit_inside_full_blocks(scheduler),\n",
        # Every engine's GPU pool bound past the full-block marks, EAGLE engines with coarse blocks too.
        "            inert_for=lambda _, scheduler: True,\n",
        ("tests/test_inert_patches.py::test_full_block_marks_only_where_a_hit_can_end_inside_one",),
        ("0.33.0",),
    ),
    Mutant(
        "byte-model-keeps-the-draft-lead-after-a-gap",
        "sim/byte_cache.py",
        "            rewind = self.drafts.get(req_id, 0) + self.undelivered_drafts.get(req_id, 0) - undelivered\n",
        # The simulator's runner as it was: after a step without the request, its start (the scheduler's
        # own, which the runner leaves as it is) reads as a rewind past its rejected drafts.
        "            rewind = self.drafts.get(req_id, 0)\n",
        ("tests/test_byte_cache.py::test_a_step_without_the_request_ends_the_draft_lead",),
        ("0.30.0",),
    ),
    Mutant(
        "junction-state-missing-from-load-reservation",
        "patches/junction_reservation.py",
        "        return reserved + reservation_owed_blocks(self.kv_cache_manager, self._inflight_prefills)\n",
        # Scheduler's reservation as the wheel counts it: an async load takes the block a running
        # prefill's junction state is copied into, and the prefill preempts itself for ever.
        "        return reserved\n",
        (
            "tests/test_shared_prefix_checkpoint.py::test_async_load_reservation_counts_the_block_the_lowered_tail_keeps",
            "tests/test_reliability_regressions.py::test_junction_state_is_reserved_against_async_loads",
        ),
        ("0.28.0",),
    ),
    Mutant(
        "eagle-full-block-hit-copies-unwritten-block",
        "patches/local_hit_admission.py",
        "                entry is not None and entry[0]() is self and kv_cache_group_id in entry[1]\n",
        # Full blocks keyed in this step are never marked: a hit EAGLE ends inside one is copied as zeros.
        "                False\n",
        ("tests/test_reliability_regressions.py::test_eagle_hit_inside_a_block_keyed_this_step_waits",),
        ("0.27.1",),
    ),
    Mutant(
        "hybrid-hit-cut-inside-an-unwritten-full-block",
        "scheduler_kind.py",
        "    if not drafts_with_eagle(scheduler) and len(managers) < 2:\n",
        # Full blocks marked under EAGLE only: a Mamba state at a unit boundary cuts a same-step
        # whole-block attention hit inside the block, and its copy reads zeros.
        "    if not drafts_with_eagle(scheduler):\n",
        (
            "tests/test_same_step_full_block_hit.py::test_hit_cut_inside_a_full_block_keyed_this_step_waits",
            "tests/test_inert_patches.py::test_full_block_marks_only_where_a_hit_can_end_inside_one",
        ),
        ("0.26.0", "0.31.0"),
    ),
    Mutant(
        "eagle-chunk-runs-past-the-block-end",
        "patches/mamba_split_keeps_block_grid.py",
        "    return boundary if boundary < end else None\n",
        # 0.26's split as shipped: a prompt chunk resumed mid-block crosses the block's end, leaving its
        # slot holding the earlier chunk's state, cached as the block-end state.
        "    return None\n",
        ("tests/test_eagle_mamba_grid.py::test_a_mid_block_chunk_stops_at_the_block_end",),
        ("0.26.0",),
    ),
    Mutant(
        "prompt-tail-keyed-again-after-its-chunk",
        "patches/prompt_tail_keyed_once.py",
        "            and request.num_computed_tokens >= num_tokens\n",
        # The guard never holds: the prompt-tail state is keyed again after a decode overwrote it.
        "            and request.num_computed_tokens >= num_tokens > 1 << 30\n",
        ("tests/test_prompt_tail_keyed_once.py::test_plugin_async_keys_it_once",),
        ("0.29.0",),
    ),
    Mutant(
        "mamba-chunk-count-uncapped",
        "patches/mamba_chunk_count_capped.py",
        "        return min(count, max(missing, 0) + owed_copy)\n",
        # The wheel's count stands: a resumed chunk owing only its copy is counted 2 blocks.
        "        return count\n",
        ("tests/test_hit_never_fits.py::test_async_b_alone_finishes_with_the_plugin",),
        ("0.29.0",),
    ),
    Mutant(
        "connector-lookup-ignores-dropped-hit",
        "patches/connector_hit_reconcile.py",
        "        if reads_no_cache(block_hashes):\n",
        # 0.26's per-group lookup keeps finding the hit the admission dropped.
        "        if False:\n",
        (
            "tests/test_hit_never_fits.py::test_plugin_recomputes_b_without_the_hit_through_its_connector",
            "tests/test_reliability_regressions.py::test_async_dropped_hit_is_read_again_after_a_preemption",
        ),
        ("0.26.0",),
    ),
    Mutant(
        "byte-model-keeps-rejected-drafts",
        "sim/byte_cache.py",
        "                self._reject_drafts(req_id, table, start, h)\n",
        # The byte model tags the slot and state with the rejected drafts' end: a false "token ahead".
        "                pass\n",
        ("tests/test_byte_cache.py::test_rejected_drafts_leave_the_accepted_state",),
        ("0.29.0",),
    ),
    Mutant(
        "admission-reserves-nothing",
        "patches/admission_reserves_running_prefills.py",
        "            kwargs[\"reserved_blocks\"] = running_prefills_need(scheduler, running)\n",
        # vLLM's own admission under deferred frees: each request against the blocks free now.
        "            pass\n",
        ("tests/test_admission_reservation.py::test_async_admission_waits_for_the_running_prefill",),
        ("0.28.0",),
    ),
    Mutant(
        "admission-reserves-for-waiting-loads",
        "patches/admission_reserves_running_prefills.py",
        "    running_ones = requests_in_status(prefills, running)\n",
        # Requests that wait themselves (loads in flight or landed) reserved too: a landed load at the
        # queue's head reserves against itself and nothing runs again.
        "    running_ones = prefills\n",
        ("tests/test_reliability_regressions.py::test_async_admissions_no_longer_preempt_each_other_for_ever",),
        ("0.28.0",),
    ),
    Mutant(
        "stock-store-walks-handed-on-mamba",
        "patches/stock_store_skips_handed_on_mamba.py",
        "                if block.block_hash is not None and block.block_hash_num_tokens != (index + 1) * size:\n",
        # The stock walk reads every entry again, blocks handed on to another request included.
        "                if False:\n",
        ("tests/test_reliability_regressions.py::test_stock_connector_stores_no_mamba_block_it_handed_on",),
        ("0.29.0",),
    ),
    Mutant(
        "lowered-tail-admission-block-uncounted",
        "junction/manager.py",
        "                return int(total_computed_tokens < tail and self._is_added_checkpoint(request, tail))\n",
        # Only the junction is counted: the EAGLE-lowered prompt tail's copy block is not reserved.
        "                return 0\n",
        ("tests/test_shared_prefix_checkpoint.py::test_admission_counts_the_block_the_lowered_tail_keeps",),
        ("0.29.0",),
    ),
    Mutant(
        "divergence-admission-block-uncounted",
        "junction/manager.py",
        "            return count + self._junction_block_owed(request_id, total_computed_tokens)\n",
        # The admission check takes the wheel's count: a divergence state's copy block is not reserved.
        "            return count\n",
        (
            "tests/test_divergence_checkpoint.py::test_admission_counts_the_block_the_divergence_state_keeps",
            "tests/test_reliability_regressions.py::test_async_divergence_admission_counts_the_kept_state_block",
        ),
        ("0.29.0",),
    ),
    Mutant(
        "prompt-tail-keyed-once-bypassed-under-async",
        "patches/prompt_tail_keyed_once.py",
        "        inert_for=lambda _, scheduler: not outputs_arrive_late(scheduler),\n",
        # Every engine calls past the fix, also under AsyncScheduler where it is needed.
        "        inert_for=lambda _, scheduler: True,\n",
        ("tests/test_prompt_tail_keyed_once.py::test_plugin_async_keys_it_once",),
        ("0.30.0",),
    ),
    Mutant(
        "cpu-copy-published-under-a-neighbours-keys",
        FINE,
        "        for cpu_block, record in zip(cpu_blocks, staged):\n",
        # Each copy takes the keys of the next staged block of the same group (same block type).
        "        same = lambda a, b: get_group_id(a.keys[0][0]) == get_group_id(b.keys[0][0])\n"
        "        staged = [next((o for o in staged[i + 1 :] + staged[:i] if same(o, r)), r) for i, r in enumerate(staged)]\n"
        "        for cpu_block, record in zip(cpu_blocks, staged):\n",
        (f"{CHECKERS}::test_clean_cpu_tier_hit_checks_every_load_and_copy",),
        ("0.29.0",),
    ),
    Mutant(
        "junction-guard-past-prompt-or-computed-removed",
        "junction/manager.py",
        "                num_tokens == request.shared_prefix_boundary\n"
        "                and request.num_computed_tokens < num_tokens <= request.num_prompt_tokens\n",
        "                num_tokens == request.shared_prefix_boundary\n",
        (JUNCTION_OUTSIDE,),
        ("0.29.0",),
    ),
    Mutant(
        "junction-lowered-tail-computed-guard-removed",
        "junction/manager.py",
        "                return request.num_computed_tokens < num_tokens\n",
        "                return True\n",
        (JUNCTION_OUTSIDE,),
        ("0.29.0",),
    ),
    Mutant(
        "same-step-copy-chains-unresolved",
        "patches/same_step_copy_chains.py",
        "        src = filled_from.get(copy.src_block_id, copy.src_block_id)\n",
        "        src = copy.src_block_id\n",
        ("tests/test_reliability_regressions.py::test_same_step_copy_chain_reads_the_bytes_it_means",),
        ("0.29.0", "0.33.0"),
    ),
    Mutant(
        "same-step-partial-hit-source-unmarked",
        "patches/local_hit_admission.py",
        "        if key is not None and num_tokens > computed:\n",
        # Marks only keys of positions already computed: the hit on this step's block is not deferred.
        "        if key is not None and num_tokens <= computed:\n",
        ("tests/test_same_step_partial_hit.py::test_partial_hit_on_a_block_this_step_writes_waits_a_step",),
        ("0.29.0", "0.33.0"),
    ),
    Mutant(
        "hit-never-fits-null-block-counted-free",
        "patches/local_hit_admission.py",
        "    return block_pool.get_num_free_blocks() >= block_pool.num_gpu_blocks - 1\n",
        # Counts the null block as one that could be free: an empty pool never looks empty.
        "    return block_pool.get_num_free_blocks() >= block_pool.num_gpu_blocks\n",
        ("tests/test_hit_never_fits.py::test_plugin_recomputes_b_without_the_hit",),
        ("0.29.0", "0.33.0"),
    ),
    Mutant(
        "hit-never-fits-drops-any-refused-hit",
        "patches/local_hit_admission.py",
        "            if num_new_computed_tokens and pool_is_empty(self.block_pool):\n",
        # Drops the hit of any refused request, also one that waits only for others to finish.
        "            if num_new_computed_tokens:\n",
        ("tests/test_hit_never_fits.py::test_plugin_keeps_a_hit_refused_while_another_request_runs",),
        ("0.29.0", "0.33.0"),
    ),
    Mutant(
        "hit-never-fits-drop-kept-for-life",
        "patches/local_hit_admission.py",
        "            request.skip_reading_prefix_cache = request.get_skip_reading_prefix_cache()\n",
        # The dropped hit stays dropped: every later admission recomputes from token 0.
        "            pass\n",
        ("tests/test_reliability_regressions.py::test_async_dropped_hit_is_read_again_after_a_preemption",),
        ("0.29.0",),
    ),
    Mutant(
        "async-load-landing-copy-not-reserved",
        "patches/async_load_landing_reservation.py",
        "            extra += LANDING_COPY_BLOCKS * sum(map(bool, map(manager.block_size.__rmod__, computed)))\n",
        # Counts the copy only for loads landing on a block boundary, where none is needed.
        "            extra += LANDING_COPY_BLOCKS * sum(map(operator.not_, map(manager.block_size.__rmod__, computed)))\n",
        ("tests/test_reliability_regressions.py::test_load_landing_inside_a_mamba_block_reserves_its_copy",),
        ("0.29.0", "0.30.0"),
    ),
    Mutant(
        "finish-store-keys-compared-by-value",
        "attention_partial_block.py",
        "    if block.block_hash is not primary:\n",
        # An evicted block re-keyed with an equal key passes: its queued store copies a block being rewritten.
        "    if block.block_hash != primary:\n",
        (
            "tests/test_finish_store_handed_on.py::test_queued_finish_store_of_a_block_handed_on_is_dropped",
            "tests/test_reliability_regressions.py::test_queued_finish_store_of_a_block_handed_on_is_dropped",
        ),
        ("0.29.0", "0.31.0", "0.33.0"),
    ),
    Mutant(
        "finish-store-backport-keys-compared-by-value",
        FINE,
        "            if not self._carries(gpu_blocks[record.gpu_block_id], record.keys):\n",
        # The backport's check before sending compares values: a block handed on and keyed again passes.
        "            if self._keys_of(gpu_blocks[record.gpu_block_id]) != record.keys:\n",
        ("tests/test_finish_store_handed_on.py::test_queued_finish_store_of_a_block_handed_on_is_dropped",),
        ("0.26.0", "0.29.0"),
    ),
    Mutant(
        "connector-path-hit-not-reconciled",
        "patches/connector_hit_reconcile.py",
        "        if len(set(hits)) <= 1:\n",
        "        if True:\n",
        ("tests/test_replay_production.py::test_long_prompt_replays_on_the_qwen3_next_geometry",),
        ("0.26.0",),
    ),
    Mutant(
        "loads-placed-from-slot-0",
        FINE,
        "            first_slot = pending.local_tokens // size\n",
        "            first_slot = 0\n",
        (f"{OFFLOAD}::test_fine_grained_external_hit_mapping",),
        ("0.29.0",),
    ),
    Mutant(
        "junction-split-stops-past-the-prompt",
        "junction/split.py",
        "    return junction if start < junction < end and junction <= request.num_prompt_tokens else None\n",
        "    return junction if start < junction < end else None\n",
        (JUNCTION_OUTSIDE,),
        ("0.29.0",),
    ),
    Mutant(
        "staged-block-not-marked-in-flight",
        FINE,
        "        self._in_flight_store_gpu_blocks.add(block_id)\n",
        "",
        # ``_stage`` (hand-offs, finish stores): a hand-off of a block already staged this step is
        # counted "already cached" instead of "in flight".
        ("tests/test_cpu_offload_plumbing.py::test_every_outcome_counted_and_exported",),
        ("0.29.0",),
    ),
    Mutant(
        "scanned-block-not-marked-in-flight",
        FINE,
        "                in_flight.add(block_id)\n",
        "",
        # The store scan's inline staging: a store completing late meets the block again, the
        # "stored twice" invariant (plugin-fa32 stores every request end).
        (
            "tests/test_reliability_statemachine.py::test_randomized_faults_keep_invariants[plugin-fa32]",
            "tests/test_reliability_statemachine.py::test_randomized_faults_keep_invariants[plugin]",
        ),
        ("0.29.0",),
        NO_SHRINK,
    ),
    Mutant(
        "pending-cpu-hit-pins-never-released",
        FINE,
        "        if pinned:\n            self.cpu_block_pool.free_blocks(pinned)\n",
        "        pass\n",
        # A CPU hit found but not loaded (its request was not admitted, or asked again).
        (
            "tests/test_reliability_statemachine.py::test_randomized_faults_keep_invariants[plugin-fa32]",
            "tests/test_reliability_statemachine.py::test_randomized_faults_keep_invariants[plugin]",
        ),
        ("0.29.0",),
        NO_SHRINK,
    ),
    Mutant(
        "attention-partial-tail-store-dropped",
        FINE,
        "        if tail is not None and tail.block_id not in batch.gpu_block_ids and not batch.full:\n",
        "        if False:\n",
        (f"{OFFLOAD}::test_attention_partial_tail_stored_once",),
        ("0.29.0",),
    ),
    Mutant(
        "failed-loads-not-reported",
        "sim/engine.py",
        "            output.failed_recving = set(req_ids)\n",
        "            pass\n",
        # Wheels that take load failures per request (0.30+ here).
        ("tests/test_reliability_statemachine.py::test_randomized_faults_keep_invariants[plugin]",),
        ("0.33.0",),
        NO_SHRINK,
    ),
    Mutant(
        "failed-loads-not-reported-by-block",
        "sim/engine.py",
        "            output.invalid_block_ids = set(gpu_ids)\n",
        "            pass\n",
        # 0.29 takes them only as invalid block ids, for a one-group (full-attention) model.
        ("tests/test_reliability_statemachine.py::test_randomized_faults_keep_invariants[passthrough-full-attention]",),
        ("0.29.0",),
        NO_SHRINK,
    ),
    Mutant(
        "prompt-tail-replay-position-one-unit-low",
        "prompt_tail/policy.py",
        "        return max((num_prompt_tokens - 1) // unit * unit - drop, 0)\n",
        "        return max((num_prompt_tokens - 1) // unit * unit - drop - unit, 0)\n",
        # 0.29-0.31 only: from 0.32 the wheel itself keeps this position (the plugin never places it).
        ("tests/test_prompt_tail_checkpoint.py::test_replay_is_the_0_33_position",),
        ("0.29.0",),
    ),
    Mutant(
        "prompt-tail-both-keeps-only-one",
        "prompt_tail/policy.py",
        "            positions = {self.replay_position(num_prompt_tokens), self.continuation_position(num_prompt_tokens)}\n",
        "            positions = {self.continuation_position(num_prompt_tokens)}\n",
        ("tests/test_prompt_tail_checkpoint.py::test_both_serves_exact_replays_and_continuations",),
        ("0.29.0", "0.33.0"),
    ),
    Mutant(
        "whole-block-boundary-handoff-dropped",
        "patches/mamba_boundary_handoffs.py",
        "            records.append((req_id, self.kv_cache_group_id, block, (index + 1) * self.block_size))\n",
        "            pass\n",
        (f"{OFFLOAD}::test_mamba_blocks_never_scanned_positionally",),
        ("0.27.1",),
    ),
    Mutant(
        "partial-state-boundary-handoff-dropped",
        "patches/mamba_boundary_handoffs.py",
        "                _records(self).append((request_id, self.kv_cache_group_id, cow_block, boundary))\n",
        "                pass\n",
        (f"{OFFLOAD}::test_fine_grained_external_hit_mapping",),
        ("0.28.0",),
    ),
    Mutant(
        "last-boundary-handoff-of-a-pass-not-published",
        "patches/boundary_handoff_publish.py",
        "        for req_id, group_id, block, boundary_tokens in take_handoffs(manager):\n",
        "        for req_id, group_id, block, boundary_tokens in take_handoffs(manager)[:-1]:\n",
        (f"{OFFLOAD}::test_fine_grained_external_hit_mapping",),
        ("0.28.0",),
    ),
    Mutant(
        "output-checkpoint-stale-state-never-dropped",
        "output_checkpoint/rolling.py",
        "    for stale in [s for s in states if s.position < floor]:\n",
        "    for stale in []:\n",
        # Every crossed boundary then keeps a Mamba block: the one-state cost bound fails.
        ("tests/test_output_checkpoint.py::test_cost_one_state_per_running_request_no_extra_step",),
        ("0.29.0", "0.33.0"),
    ),
    Mutant(
        "output-checkpoint-last-step-hand-off-dropped",
        "output_checkpoint/rolling.py",
        "            _hand_off_last_step(manager, request, holder, num_tokens)\n",
        "            pass\n",
        # An answer ending on a unit boundary: the CPU tier falls back one unit.
        ("tests/test_output_checkpoint.py::test_answer_ending_on_a_unit_boundary",),
        ("0.29.0",),
    ),
    Mutant(
        "output-checkpoint-state-one-unit-low",
        "output_checkpoint/rolling.py",
        "    key = keep_partial_state(manager, request, num_tokens, producer_holds_block)\n",
        "    key = keep_partial_state(manager, request, num_tokens - checkpoint.hash_block_size, producer_holds_block)\n",
        # The next turn's hit must be the answer's last boundary (352), CPU tier and GPU cache.
        ("tests/test_output_checkpoint.py::test_cpu_tier_serves_the_previous_answer",),
        ("0.29.0", "0.33.0"),
    ),
    Mutant(
        "output-checkpoint-answer-attention-block-not-stored",
        "attention_partial_block.py",
        "    return answer if answer is not None else request.num_prompt_tokens // hash_block_size * hash_block_size\n",
        "    return request.num_prompt_tokens // hash_block_size * hash_block_size\n",
        # FA 32: the CPU tier has the state at 336 but not the attention block holding it.
        ("tests/test_output_checkpoint.py::test_attention_block_coarser_than_the_unit",),
        ("0.29.0",),
    ),
    Mutant(
        "output-checkpoint-native-offload-ignores-the-answer",
        "patches/output_checkpoint_offload.py",
        "        answer = last_answer_position(request)\n",
        "        answer = None\n",
        # 0.30+: the wheel's SimpleCPU side stores only the prompt's partial block.
        ("tests/test_output_checkpoint.py::test_attention_block_coarser_than_the_unit",),
        ("0.33.0",),
    ),
    Mutant(
        "output-checkpoint-answer-attention-block-not-keyed",
        "patches/prompt_tail_attention.py",
        "            key_attention_block(self, request, num_tokens)\n",
        "            pass\n",
        # FA 32: the Mamba state at 336 is kept but attention reaches only 320.
        ("tests/test_output_checkpoint.py::test_attention_block_coarser_than_the_unit",),
        ("0.33.0",),
    ),
    Mutant(
        "output-checkpoint-answer-block-end-not-retained",
        "patches/prompt_tail_retention.py",
        "                replay_boundaries = (*replay_boundaries, block_end)\n",
        "                pass\n",
        # Retention 0: the answer's block end at 352 is never hashed, the next turn falls back.
        ("tests/test_output_checkpoint.py::test_engine_geometry_under_retention_0",),
        ("0.33.0",),
    ),
    Mutant(
        "inert-patches-peeled-whatever-the-option",
        "patching.py",
        "    while (inert := getattr(target, INERT_MARKER, None)) is not None and inert(obj, scheduler):\n",
        "    while (inert := getattr(target, INERT_MARKER, None)) is not None:\n",
        # Every engine would skip the prompt-tail split, option on or off.
        ("tests/test_prompt_tail_checkpoint.py::test_both_serves_exact_replays_and_continuations",),
        ("0.29.0",),
    ),
    Mutant(
        "junction-managers-call-inert-patches",
        "junction/manager.py",
        "        if target is not patched:\n",
        # The junction's managers keep calling the patched partial-tail method through every inert wrapper.
        "        if False:\n",
        ("tests/test_inert_patches.py::test_junction_switch_on_keeps_the_junction_path",),
        ("0.29.0",),
    ),
    Mutant(
        "inert-patches-bind-inline-mamba-managers",
        "inert_patches.py",
        "        elif adapter.mamba_manager_attributes_past_inline and isinstance(manager, MambaManager):\n",
        "        elif isinstance(manager, MambaManager):\n",
        # 0.29's Mamba manager keeps its attributes inline: it must get no binding.
        ("tests/test_inert_patches.py::test_options_off_bind_the_wheels_own_methods",),
        ("0.29.0",),
    ),
    Mutant(
        "prompt-tail-retention-inert-while-output-checkpoint-on",
        "patches/prompt_tail_retention.py",
        "        inert_for=lambda manager, scheduler: not prompt_tail_bound(manager) and not output_checkpoint_requested(scheduler),\n",
        "        inert_for=lambda manager, scheduler: not prompt_tail_bound(manager),\n",
        # Bound past the retention patch: the answer's block end at 352 is never hashed.
        ("tests/test_output_checkpoint.py::test_engine_geometry_under_retention_0",),
        ("0.33.0",),
    ),
    Mutant(
        "junction-open-plan-binds-the-stock-coordinator",
        "junction/coordinator.py",
        "        if not plan.enabled:\n",
        "        if True:\n",
        # The switch on would neither re-type the Mamba managers nor hand them the replay boundaries.
        ("tests/test_shared_prefix_checkpoint.py::test_switch_selects_backport_or_native",),
        ("0.29.0",),
    ),
    Mutant(
        "finish-stores-pinned-while-the-engine-idles",
        FINE,
        "            self._finish_batches.append(batch)\n",
        "            self._finish_batches.append(self._allocate(batch))\n",
        # Pinned at finish again: an idle engine holds the answer's attention block, reset refuses.
        ("tests/test_output_checkpoint.py::test_idle_engine_holds_no_block_after_the_answer",),
        ("0.29.0",),
    ),
    Mutant(
        "finish-store-pin-kept-at-queue",
        "patches/finish_store_pinning.py",
        "            pool.free_blocks(blocks)\n",
        "            pass\n",
        # The wheel's pin at finish stays (and the send pins again): an idle engine holds the block.
        ("tests/test_output_checkpoint.py::test_idle_engine_holds_no_block_after_the_answer",),
        ("0.30.0",),
    ),
    Mutant(
        "finish-store-sent-after-its-block-was-evicted",
        "patches/finish_store_pinning.py",
        "        kept = [carries_key_objects(pool, pool.blocks[b], *keys) for b, keys in zip(ids, store.keys)]\n",
        "        kept = [True for keys in store.keys]\n",
        # A GPU block evicted since the request finished is copied anyway (its keys are gone).
        ("tests/test_output_checkpoint.py::test_queued_answer_store_is_sent_unless_its_block_was_reused[evicted-before-sent]",),
        ("0.30.0",),
    ),
    Mutant(
        "divergence-gate-still-needs-eagle",
        "junction/gate.py",
        "    if not coordinator.eagle_group_ids and not divergence:\n",
        "    if not coordinator.eagle_group_ids:\n",
        # mamba_divergence_checkpoint without EAGLE would stay closed (backport plan and native gate alike).
        ("tests/test_divergence_checkpoint.py::test_third_request_resumes_at_the_divergence_point",),
        ("0.29.0", "0.33.0"),
    ),
    Mutant(
        "divergence-attention-keyed-only-at-block-ends",
        "patches/divergence_attention_keys.py",
        "        if getattr(self, MANAGER_ATTR, False):\n",
        "        if False:\n",
        # Attention blocks as coarse as the Mamba block show a lookup no divergence inside a block.
        ("tests/test_divergence_checkpoint.py::test_third_request_resumes_at_the_divergence_point",),
        ("0.29.0", "0.33.0"),
    ),
    Mutant(
        "divergence-attention-keyed-only-at-the-last-unit",
        "divergence/attention.py",
        "    for position in range(deepest // unit * unit, index * size, -unit):\n",
        "    for position in range(deepest // unit * unit, deepest // unit * unit - 1, -unit):\n",
        # Only the deepest unit boundary of each block is keyed, not every one up to it.
        ("tests/test_divergence_checkpoint.py::test_third_request_resumes_at_the_divergence_point",),
        ("0.29.0", "0.33.0"),
    ),
    Mutant(
        "divergence-keys-lost-on-preemption",
        "patches/divergence_keys_after_preemption.py",
        "        forget_keying_progress(request)\n",
        "        pass\n",
        # A request preempted after its keying finished recomputes into blocks keyed at block ends only.
        ("tests/test_divergence_checkpoint.py::test_unit_keys_reach_the_blocks_a_preempted_request_recomputes",),
        ("0.29.0", "0.33.0"),
    ),
    Mutant(
        "divergence-native-mamba-manager-keeps-no-state",
        "divergence/native.py",
        "            setattr(single, adapter.native_junction_manager_attr, True)\n",
        "            pass\n",
        # 0.30+: the split stops at the junction, but the Mamba manager keeps no state there.
        ("tests/test_divergence_checkpoint.py::test_third_request_resumes_at_the_divergence_point",),
        ("0.33.0",),
    ),
    Mutant(
        "divergence-bound-with-the-option-off",
        "divergence/binding.py",
        "    if not divergence_requested(scheduler):\n",
        "    if False:\n",
        # The junction stop and unit keys would change what a scheduler without the option does (0.30+:
        # the native gate; on 0.29 the backport's plan_of reads the option itself, so it is equivalent there).
        ("tests/test_divergence_checkpoint.py::test_option_selects_backport_or_native_gate",),
        ("0.33.0",),
    ),
    Mutant(
        "output-checkpoint-async-ignores-output-placeholders",
        "output_checkpoint/rolling.py",
        "    if request.num_output_placeholders > 0:\n        return IN_FLIGHT\n",
        "    if False:\n        return IN_FLIGHT\n",
        # AsyncScheduler: the boundary is keyed on the running block while the step just scheduled
        # overwrites it; the next turn reads the state after 353 under the key of 352 (byte check).
        ("tests/test_output_checkpoint.py::test_cpu_tier_serves_the_previous_answer[async]",),
        ("0.33.0",),
    ),
    Mutant(
        "output-checkpoint-attention-key-ignores-late-boundary",
        "patches/prompt_tail_attention.py",
        "                 or late_boundary(request, num_tokens, checkpoint) is not None)\n",
        "                 or False)\n",
        # AsyncScheduler, attention block coarser than the unit: the boundary is cached a step
        # late, the attention block is never keyed at 336 and the next turn stops at 320.
        ("tests/test_output_checkpoint.py::test_attention_block_coarser_than_the_unit[async]",),
        ("0.33.0",),
    ),
    Mutant(
        "declined-cpu-hit-left-to-the-wheel",
        "connector/simple_cpu.py",
        "            self.hybrid_kv_adapter.release_declined_cpu_hit(manager, request.request_id)\n",
        "            pass\n",
        # The wheel then unpins the declined CPU hit itself, with a warning per request
        # (252 of the first 300 conversation requests under mamba_divergence_checkpoint).
        ("tests/test_divergence_checkpoint.py::test_third_request_resumes_at_the_divergence_point[sync-gpu-qwen3-next-1216]",),
        ("0.33.0",),
    ),
    Mutant(
        "cpu-tier-reuse-not-refreshed",
        "offload/eviction.py",
        "            for cpu_block in reversed(reused):\n",
        "            for cpu_block in reversed(reused[:0]):\n",
        # The hybrid CPU-tier order forgets that a request reused a prefix from the GPU cache:
        # its CPU copy ages as under LRU and is evicted first.
        ("tests/test_cpu_tier_eviction.py::test_gpu_reuse_keeps_the_cpu_copy",),
        ("0.29.0", "0.33.0"),
    ),
    Mutant(
        "cpu-tier-answer-states-never-demoted",
        "offload/eviction.py",
        "        if prompt_tail_start(prompt, self.unit, self.tail_drop) <= boundary <= prompt:\n",
        "        if prompt_tail_start(prompt, self.unit, self.tail_drop) <= boundary:\n",
        # Answer states a later one of the same answer supersedes stay in plain LRU: the tier
        # spends a block on each unit of every answer and evicts the conversation's head instead.
        ("tests/test_cpu_tier_eviction.py::test_superseded_answer_states_are_evicted_first",),
        ("0.29.0", "0.33.0"),
    ),
    Mutant(
        "cpu-tier-demotes-whatever-it-costs",
        "offload/eviction.py",
        "            if self.ghosts.demotion_pays():\n",
        "            if True:\n",
        # The hybrid order keeps its demotion bet on a prefix tree that branches at chunk ends.
        ("tests/test_cpu_tier_eviction.py::test_demotion_stops_while_it_costs_more_than_lru",),
        ("0.29.0", "0.33.0"),
    ),
    Mutant(
        "cpu-tier-what-if-lookup-revives-nothing",
        "offload/eviction.py",
        "                if self.ghosts.kind(key) != self._reviving:\n",
        "                if True:\n",
        # What-if lookups find no more than the real one: no eviction is ever charged a token.
        ("tests/test_cpu_tier_eviction.py::test_demotion_stops_while_it_costs_more_than_lru",),
        ("0.29.0", "0.33.0"),
    ),
    Mutant(
        "cpu-tier-demoted-victims-recorded-as-plain",
        "offload/eviction.py",
        "                    self.ghosts.evicted_key(key, True)\n",
        "                    self.ghosts.evicted_key(key, False)\n",
        # The order's own victims count as LRU's: their cost never weighs against demotion.
        ("tests/test_cpu_tier_eviction.py::test_demotion_stops_while_it_costs_more_than_lru",),
        ("0.29.0", "0.33.0"),
    ),
    Mutant(
        "divergence-cpu-tier-reach-ignored",
        "divergence/cpu_tier.py",
        "        if point > request.shared_prefix_boundary and point < request.num_prompt_tokens:\n",
        "        if False:\n",
        # A request whose attention hit is on the CPU tier only keeps no state where it ends.
        ("tests/test_divergence_checkpoint.py::test_cpu_tier_only_hit_sets_the_divergence_point",),
        ("0.29.0", "0.33.0"),
    ),
    Mutant(
        "request-ends-admission-keeps-the-prompt-tail",
        "offload/admission.py",
        "or entry[2] < tail_start or",
        "or entry[2] <= tail_start or",
        # A prompt-end state exactly at the prompt's tail position reaches the CPU tier anyway.
        ("tests/test_cpu_tier_request_ends.py::test_next_turn_resumes_below_a_skipped_end",),
        ("0.29.0", "0.33.0"),
    ),
    Mutant(
        "prompt-tail-start-ignores-eagle-drop",
        "offload/admission.py",
        " - (unit if tail_drop else 0)",
        "",
        # Under EAGLE block drop the tail state one unit lower counts as a chunk end: the admission
        # stores it (unreachable without its declined partial tail), the hybrid order demotes it.
        (
            "tests/test_eagle_cpu_tier_request_ends.py::test_skip_declines_the_eagle_prompt_tail",
            "tests/test_eagle_cpu_tier_request_ends.py::test_hybrid_order_keeps_the_eagle_prompt_tail",
        ),
        ("0.29.0", "0.33.0"),
    ),
    Mutant(
        "request-ends-admission-declines-grid-ends",
        "offload/admission.py",
        "if entry[2] % sizes[entry[0]] == 0 or entry[2] < tail_start",
        "if entry[2] < tail_start",
        # A request end on the Mamba grid is declined too: the next turn loses the block-end state.
        ("tests/test_cpu_tier_request_ends.py::test_an_end_on_the_mamba_grid_is_stored",),
        ("0.29.0", "0.33.0"),
    ),
    Mutant(
        "request-ends-admission-declines-divergence-points",
        "offload/admission.py",
        " or entry[2] == divergence\n",
        "\n",
        # A divergence point that is also the prompt's end is declined: the next branch loses it.
        ("tests/test_cpu_tier_request_ends.py::test_a_divergence_point_at_the_prompt_end_is_stored",),
        ("0.29.0", "0.33.0"),
    ),
    Mutant(
        "request-ends-admission-stores-partial-tails",
        "offload/admission.py",
        "        if self.takes_request_ends():\n            return tail\n        boundary",
        "        if True:\n            return tail\n        boundary",
        # The attention partial tails of request ends still fill the CPU tier.
        ("tests/test_cpu_tier_request_ends.py::test_request_ends_push_out_a_shared_prefix",),
        ("0.29.0", "0.33.0"),
    ),
    Mutant(
        "request-ends-auto-declines-while-the-tier-has-room",
        "offload/admission.py",
        "return head is not None and head.block_hash is None",
        "return False",
        # ``auto`` behaves as skip: a next turn on a tier that never filled loses its end state.
        ("tests/test_cpu_tier_request_ends.py::test_next_turn_resumes_below_a_skipped_end",),
        ("0.29.0", "0.33.0"),
    ),
    Mutant(
        "request-ends-auto-stores-on-a-full-tier",
        "offload/admission.py",
        "return head is not None and head.block_hash is None",
        "return head is not None",
        # ``auto`` behaves as store once the tier is full: request ends push out the shared prefix.
        ("tests/test_cpu_tier_request_ends.py::test_request_ends_push_out_a_shared_prefix",),
        ("0.29.0", "0.33.0"),
    ),
    Mutant(
        "request-ends-partial-tail-declined-under-its-stored-state",
        "offload/admission.py",
        "if self._declines(request, resumes_at) and not self._state_kept(request, resumes_at):",
        "if self._declines(request, resumes_at):",
        # ``auto``: an end state stored just before the tier filled loses the attention that reaches it.
        ("tests/test_cpu_tier_request_ends.py::test_a_stored_end_state_keeps_its_partial_tail",),
        ("0.26.0", "0.29.0", "0.33.0"),
    ),
    Mutant(
        "replay-declined-request-ends-count-as-kept",
        "sim/replay.py",
        "Fate.DROPPED if (rid, position) in declined else state_fate",
        "state_fate",
        # The loss split calls a state the CPU tier never took "evicted".
        ("tests/test_replay.py::test_skipped_request_ends_show_as_dropped_hand_offs",),
        ("0.33.0",),
    ),
    Mutant(
        "tier-ceiling-lru-touches-root-first",
        "sim/tier_ceiling.py",
        "        for key in reversed(r.keys):\n",
        # LRU then evicts a prefix from its root: the tail it keeps serves nothing.
        "        for key in r.keys:\n",
        ("tests/test_tier_ceiling.py::test_lru_evicts_a_prefix_from_its_tail",),
        ("0.33.0",),
    ),
    Mutant(
        "tier-ceiling-offline-never-bypasses",
        "sim/tier_ceiling.py",
        "                if (-worst[0], -worst[1]) <= rank:\n",
        # The offline order admits every block, even one needed later than all it holds.
        "                if False:\n",
        ("tests/test_tier_ceiling.py::test_the_offline_order_passes_over_a_block_needed_later",),
        ("0.33.0",),
    ),
    Mutant(
        "tier-ceiling-ideal-of-prompts-only",
        "sim/tier_ceiling.py",
        "    keys = [history_keys(r, block_tokens) for r in requests]\n",
        # Answers never stored: a next turn cannot reuse the previous answer.
        "    keys = [history_keys(r, block_tokens)[: len(r.prompt_token_ids) // block_tokens] for r in requests]\n",
        ("tests/test_tier_ceiling.py::test_a_next_turn_reuses_the_answer_blocks",),
        ("0.33.0",),
    ),
    Mutant(
        "tier-size-hint-never-given",
        "cli/replay_inputs.py",
        "    if share < EVICTION_HINT_SHARE:\n",
        # A replay whose tier evicted half the reuse does not point at --tier-ceiling.
        "    if True:\n",
        ("tests/test_tier_ceiling.py::test_heavy_tier_evictions_point_at_the_ceiling",),
        ("0.33.0",),
    ),
    Mutant(
        "answer-state-handed-over-before-the-last-chunk",
        "output_checkpoint/rolling.py",
        "    return num_tokens == request.num_tokens and request.num_output_tokens + 1 >= request.max_tokens\n",
        # A resumed request's chunk ending short of its length, one answer token left, hands its running block over.
        "    return request.num_output_tokens + 1 >= request.max_tokens\n",
        (
            "tests/test_output_checkpoint.py::test_last_step_is_the_step_that_computes_every_token",
            "tests/test_reliability_regressions.py::test_async_resumed_request_hands_over_no_state_a_later_chunk_moves",
        ),
        ("0.33.0",),
    ),
    Mutant(
        "bench-async-scheduling-flag-dropped",
        "cli/bench.py",
        "    settings = dataclasses.replace(settings_from(args), async_scheduling=args.async_scheduling)\n",
        # `hybrid-kv bench --async-scheduling` times the plain Scheduler and says AsyncScheduler.
        "    settings = settings_from(args)\n",
        ("tests/test_bench.py::test_bench_command_drives_the_async_scheduler_on_request",),
        ("0.33.0",),
    ),
    Mutant(
        "replay-engine-ignores-async-scheduling",
        "sim/replay.py",
        "                async_scheduling=settings.async_scheduling,\n",
        # Every replay and bench engine runs the plain Scheduler whatever the settings say.
        "                async_scheduling=False,\n",
        ("tests/test_bench.py::test_plugin_step_work_stays_within_its_budget",),
        ("0.33.0",),
    ),
    Mutant(
        "remaining-blocks-record-never-consulted",
        "patches/remaining_blocks_once_per_step.py",
        "        if count is None:\n",
        # Every count asks the wheel again: the same answers, none of the savings.
        "        if True:\n",
        ("tests/test_remaining_blocks_once_per_step.py::test_recorded_counts_equal_the_wheels",),
        ("0.33.0",),
    ),
    Mutant(
        "remaining-blocks-record-outlives-its-step",
        "patches/remaining_blocks_once_per_step.py",
        "        self._hybrid_kv_remaining_blocks_this_step = {}\n        try:\n            if args or kwargs:\n                return original(self, *args, **kwargs)\n            return original(self)  # a plain call: no argument tuple and dict to build\n        finally:\n            # Outside a step the wheel's method answers: the record holds only this step's counts.\n            self._hybrid_kv_remaining_blocks_this_step = None\n",
        # The first step's record is kept for good: later steps answer from earlier ones' counts.
        "        if getattr(self, \"_hybrid_kv_remaining_blocks_this_step\", None) is None:\n            self._hybrid_kv_remaining_blocks_this_step = {}\n        try:\n            if args or kwargs:\n                return original(self, *args, **kwargs)\n            return original(self)  # a plain call: no argument tuple and dict to build\n        finally:\n            # Outside a step the wheel's method answers: the record holds only this step's counts.\n            pass\n",
        ("tests/test_remaining_blocks_once_per_step.py::test_recorded_counts_equal_the_wheels",),
        ("0.33.0",),
    ),
    Mutant(
        "cpu-tier-reset-keeps-eviction-ghosts",
        "offload/eviction.py",
        "        self.ghosts.forget_keys()\n",
        "        pass\n",
        # Keys evicted before a CPU-cache reset stay ghosts: the next lookups charge the reset's
        # losses to an eviction class (320 tokens to plain evictions in the test).
        ("tests/test_cpu_tier_eviction.py::test_a_cpu_cache_reset_is_no_eviction_loss",),
        ("0.29.0", "0.33.0"),
    ),
    Mutant(
        "store-agent-hung-call-left-running",
        "mooncake_store/agent.py",
        "                self.proc.kill()\n                self.proc.wait()\n                raise TimeoutError(",
        "                raise TimeoutError(",
        # The call gives up but the agent lives on, still busy: the tier keeps the client, whose
        # every later call waits out the timeout again; nothing is replaced.
        (
            "tests/test_mooncake_agent.py::test_a_call_the_agent_never_answers_kills_it",
            "tests/test_mooncake_agent.py::test_the_tier_replaces_an_agent_that_hung",
        ),
        ("0.33.0",),
    ),
    Mutant(
        "divergence-keys-lost-when-their-block-fills",
        "divergence/attention.py",
        "        _key_block_interior(manager, request, top // size, top)\n        keyed = _NEVER\n",
        "        keyed = _NEVER\n",
        # The block holding the prompt's end keeps no unit key once the answer fills it: a sibling
        # sharing 800 tokens sees no divergence (junction 0) and the next one hits 544, not 800.
        ("tests/test_divergence_checkpoint.py::test_unit_keys_outlive_the_answer_that_fills_their_block",),
        ("0.29.0", "0.33.0"),
    ),
    Mutant(
        "divergence-keys-lost-when-a-chunk-fills-their-block",
        "divergence/attention.py",
        "        for index in range(keyed // size, limit // size + 1):\n",
        "        for index in range((keyed + unit) // size, limit // size + 1):\n",
        # The block the last chunk ended in is not keyed again: a prefill stopped at 48 and the
        # chunk that fills block 0 leave it no unit key (16, 32, 48 dropped by its promotion).
        ("tests/test_divergence_checkpoint.py::test_unit_keys_outlive_the_chunk_that_fills_their_block",),
        ("0.29.0", "0.33.0"),
    ),
    Mutant(
        "request-ends-partial-tail-ignores-eagle-drop",
        "offload/admission.py",
        "        resumes_at = boundary - self.unit if self.resume_drop else boundary\n",
        "        resumes_at = boundary\n",
        # Under EAGLE block drop ``skip`` declines the partial tail a hit resuming at a stored grid state
        # reads: the next turn hits nothing instead of 320.
        ("tests/test_eagle_cpu_tier_request_ends.py::test_skip_declines_both_eagle_tail_positions",),
        ("0.29.0", "0.33.0"),
    ),
    Mutant(
        "store-breaker-opens-for-a-queued-lookup",
        "mooncake_store/tier.py",
        "        if serving is None or now - serving < self.lookup_timeout_s:\n",
        # A lookup that only waited behind healthy ones opens the breaker: load turns the store off.
        "        if False:\n",
        ("tests/test_mooncake_store_connector.py::test_lookup_that_waited_behind_healthy_lookups_is_dropped_without_opening_the_breaker",),
        ("0.33.0",),
    ),
    Mutant(
        "store-put-thread-dies-on-a-reader-error",
        "mooncake_store/tier.py",
        "            except Exception as err:  # noqa: BLE001 - a block reader or the release failed: the thread goes on\n",
        # The put thread ends at the first reader that raises: later batches stay queued and pinned.
        "            except ZeroDivisionError as err:\n",
        ("tests/test_mooncake_store_connector.py::test_reader_that_raises_neither_stops_the_put_thread_nor_keeps_blocks_pinned",),
        ("0.33.0",),
    ),
    Mutant(
        "store-dead-client-kept",
        "mooncake_store/tier.py",
        "        if alive is None or alive():\n",
        # A client whose process died is never replaced: every call fails until the engine restarts.
        "        if True:\n",
        ("tests/test_mooncake_store_connector.py::test_client_whose_process_died_is_replaced_once",),
        ("0.33.0",),
    ),
    Mutant(
        "store-waiting-batches-not-blocks",
        "mooncake_store/tier.py",
        "            self._waiting_blocks += len(items)\n",
        # Each batch counts one, however many blocks it pins.
        "            self._waiting_blocks += 1\n",
        ("tests/test_mooncake_store_connector.py::test_blocks_waiting_for_the_put_thread_are_bounded_in_blocks",),
        ("0.33.0",),
    ),
)
