"""Seeds the randomized runs once failed on, kept as fixed regressions.

* seed 0, ``passthrough-full-attention``, 240 steps (failed at step 209 on vLLM 0.29.0,
  step 97 with the first harness): ``OffloadInvariants`` (sim/invariants.py) reported
  "GPU block N stored again ... which still holds it" for a legitimate re-store - the
  earlier copy's CPU block had been evicted (or dropped by a CPU-cache reset) and
  reused, for other content or for the same key by this very store, which the stock
  connector stamps on the CPU block at once. ``EventAwareOffloadInvariants`` tracks
  the copy by its store event; this run must stay clean on every wheel.

* the async-load deadlock of vLLM 0.29-0.33 (``patches/async_load_liveness.py``):
  the 10,000-step soak of each of these wheels stopped making progress - nothing
  running, requests waiting forever - after a load failed with nothing valid. With
  the plugin's switch off, the seed below reproduces the hang on the stock wheel;
  with it on (the default) the same program runs to idle with no violation.
"""

from __future__ import annotations

import dataclasses

import pytest

from hybrid_kv_plugin.connector_names import CONNECTOR_NAME

from soak.harness import DRAIN_LIMIT, soak, soak_clean, soak_pinned, variants


def _variant(adapter, name):
    """The named variant, with every request end stored on the plugin's connector: the seeds and
    figures below were found that way (the default before cpu_tier_request_ends auto), and auto,
    declining ends once the tier fills, sends a seed's run elsewhere."""
    variant = next(v for v in variants(adapter) if v.name == name)
    if variant.connector != CONNECTOR_NAME:
        return variant
    return dataclasses.replace(variant, extra=(*variant.extra, ("cpu_tier_request_ends", "store")))


def _junction_fa32(adapter):
    """The soak's ``plugin-junction`` variant (the junction checkpoint under EAGLE) with 32-token attention blocks."""
    junction = next(v for v in variants(adapter) if v.name == "plugin-junction")
    return dataclasses.replace(junction, name="plugin-junction-fa32", attention_block_size=32)


def _plugin_fa64(adapter):
    """The soak's ``plugin`` variant with 64-token attention blocks (the Mamba block's size)."""
    plain = next(v for v in variants(adapter) if v.name == "plugin")
    return dataclasses.replace(plain, name="plugin-fa64", attention_block_size=64)


def _divergence_variant(adapter, name):
    """The named variant with the divergence option, or None where the wheel refuses it at start-up (0.26-0.28)."""
    variant = next((v for v in variants(adapter) if v.name == name), None)
    assert (variant is None) == (not adapter.divergence_checkpoint_supported)
    return variant


# Exact figures of the seed-0 re-store run (the same on every wheel): steps, requests,
# invariant checks. The program stops adding work at 240 steps, then drains.
RESTORE_RUN = (250, 29, 1768)


def test_seed0_full_attention_restore_is_not_a_duplicate(plugin, adapter):
    counts, checks, violations = soak(adapter, _variant(adapter, "passthrough-full-attention"), 240, seed=0)
    assert violations == []
    assert (counts.steps, counts.requests, checks) == RESTORE_RUN


# Per wheel: the variant, seed and step budget whose program deadlocked the stock
# scheduler, the requests left stuck, the figures of that stuck run and of the fixed run
# (steps, requests, failed loads).
DEADLOCK_SEEDS = {
    "0.29.0": (
        "passthrough-full-attention", 0, 10_000,
        "['q869', 'q870', 'q871', 'q874', 'q876', 'q877', 'q878', 'q880', 'q881']", (14_017, 882, 42), (10_008, 1103, 62),
    ),
    "0.30.0": ("plugin-lazy", 0, 2_000, "['q149', 'q150']", (7402, 151, 4), (2000, 207, 8)),
    "0.31.0": ("stock", 1, 2_000, "['q150', 'q151', 'q152']", (7376, 153, 5), (2001, 212, 6)),
    "0.32.0": ("stock", 8, 2_000, "['q138', 'q139', 'q140']", (7258, 142, 10), (2014, 226, 19)),
    "0.33.0": ("stock", 1, 2_000, "['q150', 'q151', 'q152']", (7376, 153, 6), (2000, 212, 7)),
}
# Programs that still deadlock when only the stale reservations are dropped: the queue
# order (block holders first) is needed as well. (variant, seed, steps, stuck requests)
ORDER_SEEDS = {
    "0.29.0": ("passthrough-full-attention", 2, 10_000, "['q846', 'q847', 'q848']"),
    # 0.30/0.31: with patch finish_store_pinning, stock seed 8 drains with either half alone (a finished
    # request's GPU blocks are free one step earlier); these programs still need the order.
    "0.30.0": ("plugin-fa32", 15, 2_000, "['q92', 'q93', 'q94', 'q95', 'q96', 'q97', 'q98', 'q99']"),
    "0.31.0": ("plugin-tail-both", 8, 2_000, "['q138', 'q139', 'q140']"),
    "0.32.0": ("stock", 8, 2_000, "['q138', 'q139', 'q140']"),
    "0.33.0": ("stock", 8, 2_000, "['q138', 'q139', 'q140']"),
}


# 0.26-0.28 reserve for async loads too, but 0.29's deadlocking program, cut to 2,000 steps, fails
# loads there and still runs to idle, the plugin's switch off or on (no failed-load patch goes in;
# the landing reservation below does). (variant, seed, steps, figures: steps, requests, failed loads)
NO_RESERVATION_RUNS = {
    "0.26.0": ("passthrough-full-attention", 0, 2_000, (2005, 215, 6)),
    "0.27.1": ("passthrough-full-attention", 0, 2_000, (2005, 215, 6)),
    "0.28.0": ("passthrough-full-attention", 0, 2_000, (2005, 215, 6)),
}


@pytest.fixture
def deadlock_seed(adapter):
    """The wheel's deadlocking program, or None where failed loads leave no stale reservation (0.26-0.28)."""
    assert (adapter.first_waiting_queue_attr is None) == (adapter.version in NO_RESERVATION_RUNS)
    return DEADLOCK_SEEDS.get(adapter.version)


def _runs_to_idle_without_reservations(adapter, **plugin_options) -> None:
    name, seed, steps, figures = NO_RESERVATION_RUNS[adapter.version]
    counts, _, violations = soak(adapter, _variant(adapter, name), steps, seed, plugin_options=plugin_options)
    assert violations == []
    assert (counts.steps, counts.requests, counts.failed_loads) == figures


def test_failed_async_load_deadlocks_the_stock_scheduler(plugin, adapter, deadlock_seed):
    if deadlock_seed is None:
        _runs_to_idle_without_reservations(adapter, async_load_liveness=False)
        return
    name, seed, steps, stuck, stuck_run, _ = deadlock_seed
    counts, _, violations = soak(adapter, _variant(adapter, name), steps, seed, plugin_options={"async_load_liveness": False})
    # The drain gives up after DRAIN_LIMIT idle-less steps, then the final drain does too.
    assert [v.split(": ", 1)[1] for v in violations] == [f"not idle after {DRAIN_LIMIT} steps ({stuck} live)"] * 2
    # The hang follows failed loads (the fixed run below makes more: it gets further).
    assert (counts.steps, counts.requests, counts.failed_loads) == stuck_run


def test_failed_async_load_no_longer_deadlocks(plugin, adapter, deadlock_seed):
    if deadlock_seed is None:
        _runs_to_idle_without_reservations(adapter)
        return
    name, seed, steps, _, _, fixed = deadlock_seed
    counts, _, violations = soak(adapter, _variant(adapter, name), steps, seed)
    assert violations == []
    assert (counts.steps, counts.requests, counts.failed_loads) == fixed


def test_queue_order_half_is_needed(plugin, adapter, deadlock_seed, monkeypatch):
    """Dropping stale reservations alone still strands a finished load behind a block-less head."""
    from hybrid_kv_plugin.patches import async_load_liveness

    if deadlock_seed is None:  # no stale reservations, no patch: nothing to ablate
        assert "async_load_liveness" not in [spec.name for spec in plugin.patch_set.specs]
        return
    name, seed, steps, stuck = ORDER_SEEDS[adapter.version]
    # Ablate the plugin's own second step (not vLLM code): the first one alone does not suffice.
    monkeypatch.setattr(async_load_liveness, "put_block_holders_first", lambda scheduler, adapter: False)
    _, _, violations = soak(adapter, _variant(adapter, name), steps, seed)
    assert [v.split(": ", 1)[1] for v in violations] == [f"not idle after {DRAIN_LIMIT} steps ({stuck} live)"] * 2
    monkeypatch.undo()
    _, _, violations = soak(adapter, _variant(adapter, name), steps, seed)
    assert violations == []


def test_liveness_patch_is_installed_exactly_where_loads_reserve(plugin, adapter):
    installed = [spec.name for spec in plugin.patch_set.specs if spec.name == "async_load_liveness"]
    expected = {"0.29.0": "skipped_waiting", "0.30.0": "skipped_waiting"}.get(
        adapter.version, "kv_holding_waiting" if adapter.version >= "0.31" else None
    )
    assert adapter.first_waiting_queue_attr == expected
    assert installed == (["async_load_liveness"] if expected else [])


def test_changed_schedule_leaves_the_plugin_inert(no_plugin, adapter, deadlock_seed, monkeypatch):
    import hybrid_kv_plugin
    from hybrid_kv_plugin import registration
    from vllm.v1.core.sched.scheduler import Scheduler

    def schedule(self, throttle_prefills=False):  # reads none of the state the patch edits
        raise AssertionError("never called")

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    hybrid_kv_plugin.register()
    assert Scheduler.schedule is schedule
    assert registration.STATE.status == "mismatch"
    if deadlock_seed is None:
        # 0.26-0.28: only remaining_blocks_once_per_step reads schedule() (the sum its record serves).
        gone = "_inflight_prefill_reserved_blocks, kv_cache_manager"
    else:
        gone = ", ".join(sorted({"_inflight_prefills", "policy", adapter.first_waiting_queue_attr}))
    assert registration.STATE.reason.startswith(
        "patch target vllm.v1.core.sched.scheduler:Scheduler.schedule changed (reads different scheduler "
        f"attributes (new: -; gone: {gone}))"
    )


# ---------------------------------------------------------------------------------------------
# Same-step copy chains (patches/same_step_copy_chains.py), found by the byte check: seed 0 of
# ``plugin-fa32`` (attention 32 over a 16-token unit) admits requests in one step that hit a
# cached partial block (0.28+: q223, then q225 at 80 tokens; 0.26/0.27: q416 and q417 read at
# 208). An earlier one's private copy of it is a later one's hit, and the worker runs a step's
# copies as one batch, so that copy reads the zeroed block. Per wheel: the steps the soak
# runs, and each zeroed read of the unpatched run as (step, request, chunk end, block id).
def _zeroed_read(step: int, request: str, hit: int, chunk_end: int, block: int) -> str:
    return (f"step {step}: {request}: attention (group 0) before tokens {hit}..{chunk_end}: 1 wrong: "
            f"block {block} holds zeroed, expected group 0 content up to token {hit}")


COPY_CHAIN_RUNS = {
    # Every wheel runs patch async_load_landing_reservation (a load's reservation moves the program;
    # on 0.26.0 this one's reads stay where they were without it).
    "0.26.0": (4_200, [(4127, "q416", 208, 240, 17), (4127, "q417", 208, 256, 5)]),  # as 0.29's
    "0.27.1": (4_200, [(4144, "q416", 208, 240, 11), (4144, "q417", 208, 256, 19)]),  # as 0.29's
    "0.28.0": (2_400, [(2263, "q225", 80, 96, 10)]),  # as 0.29's
    "0.29.0": (2_400, [(2246, "q225", 80, 96, 13)]),  # finish-time stores pinned when sent
    # 0.30+: the same, through patch finish_store_pinning.
    "0.30.0": (2_400, [(2251, "q225", 80, 96, 3)]),
    "0.31.0": (2_400, [(2247, "q225", 80, 96, 12)]),
    "0.32.0": (2_400, [(2268, "q225", 80, 96, 15)]),
    "0.33.0": (2_400, [(2268, "q225", 80, 96, 15)]),
}


def test_same_step_copy_chain_reads_the_bytes_it_means(plugin, adapter, monkeypatch):
    from hybrid_kv_plugin import scheduler_kind
    from hybrid_kv_plugin.patches import same_step_copy_chains

    steps, zeroed_reads = COPY_CHAIN_RUNS[adapter.version]
    variant = _variant(adapter, "plugin-fa32")
    counts, _, violations = soak(adapter, variant, steps, seed=0)
    assert violations == []
    assert counts.byte_violations == 0
    # Since local_hit_admission marks a hybrid engine's full blocks keyed in the step, the later hit
    # waits a step and no chain forms here. Without the marks (the program before them) the chain
    # forms and the resolution serves it.
    monkeypatch.setattr(scheduler_kind, "groups_hit_inside_full_blocks", lambda scheduler: frozenset())
    counts, _, violations = soak(adapter, variant, steps, seed=0)
    assert (violations, counts.byte_violations) == ([], 0)
    # Ablate the plugin's own resolution too (not vLLM code): the chain reads a zeroed block again.
    monkeypatch.setattr(same_step_copy_chains, "resolve_copy_chains", lambda copies: copies)
    _, _, violations = soak(adapter, variant, steps, seed=0)
    assert violations == [_zeroed_read(*read) for read in zeroed_reads]


def test_copy_chains_resolve_to_the_first_source():
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy as Copy

    from hybrid_kv_plugin.patches.same_step_copy_chains import resolve_copy_chains

    # 5 -> 17, then 17 -> 7 and 7 -> 9 in the same step; 3 -> 4 stands alone.
    chain = [Copy(5, 17), Copy(3, 4), Copy(17, 7), Copy(7, 9)]
    assert resolve_copy_chains(chain) == [Copy(5, 17), Copy(3, 4), Copy(5, 7), Copy(5, 9)]


def test_store_check_accepts_keys_a_hit_adds_to_the_source_while_it_is_copied(plugin, adapter):
    """vLLM 0.30+ publishes a CPU copy under the keys its GPU source carries when the store completes.
    Seed 11 of ``plugin-divergence-fa64`` on 0.33.0: a full block is staged at step 5,777 under its
    block key; at 5,778 another request's hit keys the same block at 16, 32 and 48 (prefixes of its own
    content) before the store completes, and the copy is published under all four. The store check
    (sim/invariants.py) once called those keys foreign; they are the source's own."""
    if not adapter.has_native_fine_grained_cpu_hits:  # the 0.26-0.29 backport publishes the keys it staged
        assert adapter.version < "0.30"
        return
    # The variant as the soak runs it (request ends ``auto``), the run that found it.
    variant = next(v for v in variants(adapter) if v.name == "plugin-divergence-fa64")
    counts, _, violations = soak(adapter, variant, 6_000, seed=11)
    assert violations == [] and counts.byte_violations == 0
    assert counts.steps >= 6_000 and counts.stores > 1_000


# A load landing inside a Mamba block (patches/async_load_landing_reservation.py): per wheel, a seed of
# ``plugin-divergence-fa64`` (as the soak runs it; 0.26-0.28, which have no divergence states:
# ``plugin`` with 64-token attention blocks) whose program stalls without the landing reservation:
# (seed, the requests left stuck, steps of the stalled run, steps of the fixed run).
LANDING_SEEDS = {
    "0.26.0": (8, "['q61', 'q62', 'q63', 'q64', 'q65', 'q66', 'q67', 'q68']", 6752, 10010),
    "0.27.1": (8, "['q61', 'q62', 'q63', 'q64', 'q65', 'q66', 'q67', 'q68']", 6759, 10000),
    "0.28.0": (8, "['q61', 'q62', 'q63', 'q64', 'q65', 'q66', 'q67', 'q68']", 6757, 10007),
    "0.29.0": (11, "['q230', 'q231']", 8563, 10001),
    "0.30.0": (2, "['q471', 'q472', 'q473']", 10743, 10026),
    "0.31.0": (3, "['q804', 'q805', 'q806', 'q808', 'q809', 'q810', 'q812', 'q813', 'q814']", 14429, 10005),
    # 0.32's seed 3 stalled q805-q815 (fixed run 10,011 steps) before the divergence keys outlived their
    # block filling, then q417-q422 (10,013 before local_hit_admission: two requests there, q651 and q697,
    # found a hit that made them too large for the empty pool and waited for a GPU-cache reset), and
    # q659-q664 (13,006 steps) since a stored request-end state keeps its attention partial tail, and
    # q805-q815 again since a preempted request's recomputed blocks are keyed at every unit.
    "0.32.0": (3, "['q805', 'q806', 'q807', 'q809', 'q810', 'q811', 'q813', 'q814', 'q815']", 14475, 10002),
    "0.33.0": (3, "['q805', 'q806', 'q807', 'q809', 'q810', 'q811', 'q813', 'q814', 'q815']", 14475, 10002),
}


def test_load_landing_inside_a_mamba_block_reserves_its_copy(plugin, adapter, monkeypatch):
    from hybrid_kv_plugin.patches import async_load_landing_reservation

    assert "async_load_landing_reservation" in {spec.name for spec in plugin.patch_set.specs}  # every wheel
    seed, stuck, stalled_steps, fixed_steps = LANDING_SEEDS[adapter.version]
    if adapter.divergence_checkpoint_supported:
        variant = next(v for v in variants(adapter) if v.name == "plugin-divergence-fa64")
    else:
        variant = _plugin_fa64(adapter)
    counts, _, violations = soak(adapter, variant, 10_000, seed)
    assert violations == [] and counts.steps == fixed_steps
    if adapter.version == "0.33.0":
        # The async_load_liveness switch off turns this count off too (and the liveness fix): the
        # wheel's own stall. Seed 25 (this test's seed until the divergence keys outlived their block
        # filling), where the count left on stalls elsewhere (6,894 steps, q99); at seed 3
        # both stalled at q106/q107.
        counts, _, violations = soak(adapter, variant, 10_000, 25, plugin_options={"async_load_liveness": False})
        wheel_stall = "['q59', 'q61', 'q62', 'q63', 'q64', 'q66', 'q67', 'q70', 'q71', 'q72']"
        assert [v.split(": ", 1)[1] for v in violations] == [f"not idle after {DRAIN_LIMIT} steps ({wheel_stall} live)"] * 2
        assert counts.steps == 6_620
    # Ablate the plugin's count (not vLLM code): two block holders wait for each other again.
    monkeypatch.setattr(async_load_landing_reservation, "landing_copy_blocks", lambda manager, requests, status: 0)
    counts, _, violations = soak(adapter, variant, 10_000, seed)
    assert [v.split(": ", 1)[1] for v in violations] == [f"not idle after {DRAIN_LIMIT} steps ({stuck} live)"] * 2
    assert counts.steps == stalled_steps


# A finished request's queued store sent after its block was handed on (patches/finish_store_pinning.py):
# per wheel, a seed of ``plugin-hybrid-tier-fa64`` (as the soak runs it) where a new request with the same
# prefix re-keys the evicted block before the store is sent: (seed, the violation of the equal-keys check).
# 0.32 and 0.33 reproduced it at seed 25 too (step 5,608) until a stored request-end state kept its partial
# tail; since then no seed of 0-151 of this variant, nor of 0-41 of ``plugin-chat-options-fa64``, does there
# (and since a preempted request's blocks are keyed again: none of 0-100 on 0.33, of 0-80 on 0.30).
# tests/test_finish_store_handed_on.py builds the case deterministically on every wheel.
REKEYED_SEEDS = {
    "0.31.0": (25, "step 5608: store issued at step 5607: source GPU blocks [6] changed while it was in flight"),
}


def test_queued_finish_store_of_a_block_handed_on_is_dropped(plugin, adapter, monkeypatch):
    from hybrid_kv_plugin.patches import finish_store_pinning
    from scenarios.output_checkpoint import keys_compared_by_value

    installed = any(spec.name.startswith("finish_store_pinning.") for spec in plugin.patch_set.specs)
    assert installed == adapter.has_native_fine_grained_cpu_hits  # 0.30+; the 0.29 backport pins when it sends
    if not installed:
        assert adapter.version < "0.30"
        return
    if adapter.version not in REKEYED_SEEDS:  # no seed found that re-keys a block before its store goes out
        assert adapter.version in ("0.30.0", "0.32.0", "0.33.0")  # 0.30: none of 0-120 (0-80 since)
        return
    seed, violation = REKEYED_SEEDS[adapter.version]
    variant = next(v for v in variants(adapter) if v.name == "plugin-hybrid-tier-fa64")
    counts = soak_clean(adapter, variant, seed)
    # Compare values, as before (the plugin's check, not vLLM code): the copy reads a block being rewritten.
    monkeypatch.setattr(finish_store_pinning, "carries_key_objects", keys_compared_by_value)
    _, _, violations = soak(adapter, variant, 10_000, seed)
    assert violations == [violation]


# vLLM's prompt-tail Mamba state keyed again under AsyncScheduler (patches/prompt_tail_keyed_once.py):
# per wheel, a seed of the `stock` variant that reads or loads a state one token past its hash boundary
# without the fix (0.30.0 seed 4: step 6,154, q656's 16-token hit holds the state after 17; 0.29.0 seed 1:
# step 9,574, q1041's hit at 96 holds the state after 97), and (steps, loads whose bytes were checked) of
# the fixed run (with mamba_chunk_count_capped on 0.29-0.30; before it 0.30.0 seed 3 showed the bug).
# 0.26-0.28 run stock vLLM's soak on 64-token units, which leave no prompt tail inside a block
# (tests/test_prompt_tail_keyed_once.py covers those wheels); 0.32+ keep their prompt-tail state where
# no decode reaches it.
ASYNC_PROMPT_TAIL_SEEDS = {"0.29.0": (1, 10_018, 216), "0.30.0": (4, 10_013, 182), "0.31.0": (1, 10_002, 159)}


@pytest.mark.parametrize("scheduling", ["async"], indirect=True)
def test_async_soak_reads_no_mamba_state_past_its_boundary(plugin, adapter, scheduling):
    if adapter.version not in ASYNC_PROMPT_TAIL_SEEDS:
        assert adapter.version in ("0.26.0", "0.27.1", "0.28.0", "0.32.0", "0.33.0")
        return
    seed, steps, checked_loads = ASYNC_PROMPT_TAIL_SEEDS[adapter.version]
    counts, _, violations = soak(adapter, _variant(adapter, "stock"), 10_000, seed)
    assert violations == [] and counts.byte_violations == 0
    assert (counts.steps, counts.byte_checked_loads) == (steps, checked_loads)


# A refused hit dropped for one admission only (patches/local_hit_admission.py): under AsyncScheduler
# 0.29 preempts q303 (318-token prompt) at its first decode; resumed, it must read the prefix cache
# again. With the drop kept for the request's life it recomputed from token 0 for ever (seed 8, step
# 6,375; seed 3 likewise). On 0.26 the connector path's per-group lookup must honour the drop too
# (connector_hit_reconcile; without it q303 waited with its hit from step 6,374 on). Per wheel where
# a seed was pinned: (seed, steps of the fixed run).
ONE_ADMISSION_DROP_SEEDS = {"0.26.0": (8, 10_018), "0.29.0": (8, 10_009)}


@pytest.mark.parametrize("scheduling", ["async"], indirect=True)
def test_async_dropped_hit_is_read_again_after_a_preemption(plugin, adapter, scheduling):
    seed, steps = ONE_ADMISSION_DROP_SEEDS.get(adapter.version, (8, None))
    counts, _, violations = soak(adapter, _plugin_fa64(adapter), 10_000, seed)
    assert violations == [] and counts.byte_violations == 0 and counts.steps >= 10_000
    if steps is not None:
        assert counts.steps == steps


# The block a divergence state keeps, counted at admission (junction/manager.py, 0.29's backport):
# 0.29's AsyncScheduler defers a preempted request's blocks a step, so two diverging requests
# admitted into the last free blocks, each needing one more after its divergence chunk, preempted
# each other and restarted for ever (seed 22: step 7,947, q435/q436, 7,963 since the divergence keys outlive
# their block filling, 7,949 since a stored request-end state keeps its partial tail; seeds 5 and 20 likewise).
# Since patch admission_reserves_running_prefills the second admission also waits for the first's
# remaining blocks, which keeps this seed live on its own. Since a preempted request's recomputed blocks
# are keyed at every unit (divergence_keys_after_preemption) no seed of 0-250 stalls with neither rule:
# the run without both is pinned too, and the count is shown on its own by
# tests/test_divergence_checkpoint.py::test_admission_counts_the_block_the_divergence_state_keeps. Steps of
# the run on 0.29 with both rules, with only the count, with only the reservation, with neither; 0.30+ keep
# the wheel's own count (no seed of 0-200 stalled there).
DIVERGENCE_ADMISSION_SEED = 22
DIVERGENCE_ADMISSION_STEPS = {"both": 10_006, "count only": 10_017, "reservation only": 10_019, "neither": 10_013}


@pytest.mark.parametrize("scheduling", ["async"], indirect=True)
def test_async_divergence_admission_counts_the_kept_state_block(plugin, adapter, scheduling, monkeypatch):
    from hybrid_kv_plugin.patches import admission_reserves_running_prefills

    variant = _divergence_variant(adapter, "plugin-divergence-fa64")
    if variant is None:
        return
    seed = DIVERGENCE_ADMISSION_SEED
    counts = soak_clean(adapter, variant, seed)
    if adapter.native_junction_manager_attr is not None:
        return
    steps = {"both": counts.steps}
    # Each rule alone (the plugin's code zeroed, not vLLM's), then neither.
    from vllm.v1.core import kv_cache_coordinator

    manager_cls = kv_cache_coordinator.HybridKVCacheCoordinator._junction_manager_cls
    real_owed = manager_cls._junction_block_owed
    real_need = admission_reserves_running_prefills.running_prefills_need
    for name, owed, need in (
        ("count only", real_owed, lambda scheduler, running: 0),
        ("reservation only", lambda self, request_id, computed: 0, real_need),
        ("neither", lambda self, request_id, computed: 0, lambda scheduler, running: 0),
    ):
        monkeypatch.setattr(manager_cls, "_junction_block_owed", owed)
        monkeypatch.setattr(admission_reserves_running_prefills, "running_prefills_need", need)
        counts, _, violations = soak(adapter, variant, 10_000, seed)
        assert violations == [] and counts.byte_violations == 0
        steps[name] = counts.steps
    assert steps == DIVERGENCE_ADMISSION_STEPS


# The stock connector's walk of a block another request took over (patches/stock_store_skips_handed_on_mamba.py,
# 0.26-0.29): under Scheduler, ``stock`` seed 6 on 0.29 stored q1017's Mamba index 2, block 20, at step
# 9,832, while q1020 held it as its running block keyed at 224 and rewrote it at step 9,833.
# (steps, byte-checked loads) of the fixed run on 0.29; every wheel runs the seed clean.
HANDED_ON_STORE_SEED = (6, 10_001, 211)


def test_stock_connector_stores_no_mamba_block_it_handed_on(plugin, adapter, monkeypatch):
    from hybrid_kv_plugin.patches import stock_store_skips_handed_on_mamba

    seed, steps, checked_loads = HANDED_ON_STORE_SEED
    counts, _, violations = soak(adapter, _variant(adapter, "stock"), 10_000, seed)
    assert violations == [] and counts.byte_violations == 0 and counts.steps >= 10_000
    installed = any(spec.name == "stock_store_skips_handed_on_mamba" for spec in plugin.patch_set.specs)
    assert installed == adapter.simplecpu_scans_mamba_positionally  # 0.26-0.29
    if adapter.version != "0.29.0":
        return
    assert (counts.steps, counts.byte_checked_loads) == (steps, checked_loads)
    # The wheel's walk as it was (the plugin's nulling off, not vLLM code): the store reads a block being rewritten.
    monkeypatch.setattr(stock_store_skips_handed_on_mamba, "null_handed_on_entries", lambda offload, groups: 0)
    _, _, violations = soak(adapter, _variant(adapter, "stock"), 10_000, seed)
    assert violations == ["step 9834: store issued at step 9832: source GPU blocks [20] changed while it was in flight"]


# Two requests admitted together that preempt each other for ever (patches/admission_reserves_running_prefills.py):
# under AsyncScheduler a preempted request's blocks come back a step later, so on 0.28.0 (`plugin`,
# seed 24) q934 (303 tokens, hit 192) and q935 (304, hit 256), each admitted against the blocks free
# then, left 2 where q934's next chunk needs 4, and were admitted the same way again until the drain gave up at step 11,797
# on (seeds 4 and 35 likewise). (seed, steps, byte-checked loads) of the fixed run on 0.28.0; every
# wheel runs the seed clean.
RUNNING_PREFILLS_SEED = (24, 10_014, 142)


@pytest.mark.parametrize("scheduling", ["async"], indirect=True)
def test_async_admissions_no_longer_preempt_each_other_for_ever(plugin, adapter, scheduling, monkeypatch):
    from hybrid_kv_plugin.patches import admission_reserves_running_prefills

    seed, steps, checked_loads = RUNNING_PREFILLS_SEED
    counts, _, violations = soak(adapter, _variant(adapter, "plugin"), 10_000, seed)
    assert violations == [] and counts.byte_violations == 0 and counts.steps >= 10_000
    if adapter.version != "0.28.0":
        return
    assert (counts.steps, counts.byte_checked_loads) == (steps, checked_loads)
    # The patch's count zeroed (the plugin's code, not vLLM's): the two are admitted together for ever.
    # The drain gives up at step 11,797 under PYTHONHASHSEED=0 in any test order (11,783 is this seed with
    # request ends on auto, the command-line soak's default; other hash seeds give 11,798: vLLM frees a
    # finished load's CPU blocks in the order of a set of request ids).
    monkeypatch.setattr(admission_reserves_running_prefills, "running_prefills_need", lambda scheduler, running: 0)
    counts, _, violations = soak(adapter, _variant(adapter, "plugin"), 10_000, seed)
    first, second = (int(v.split(":", 1)[0].removeprefix("step ")) for v in violations)
    assert (first, second) == (11_797, 11_797 + DRAIN_LIMIT)
    assert [v.split(": ", 1)[1] for v in violations] == [f"not idle after {DRAIN_LIMIT} steps (['q934', 'q935'] live)"] * 2


# EAGLE + Mamba align on 0.26 (patches/mamba_split_keeps_block_grid.py): a prompt chunk resumed
# inside a Mamba block ran past the block's end, and the slot it left holding the earlier chunk's
# state was cached as the block-end state. (seed, steps, byte-checked loads) of the fixed 0.26.0
# run of `plugin-junction` (the junction checkpoint under EAGLE); every wheel runs the seed clean.
EAGLE_GRID_SEED = (0, 10_000, 279)


def test_eagle_prompt_chunks_keep_the_mamba_grid(plugin, adapter, monkeypatch):
    from hybrid_kv_plugin.patches import mamba_split_keeps_block_grid

    variant = next(v for v in variants(adapter) if v.name == "plugin-junction")  # request ends: auto
    if not soak_pinned(adapter, variant, EAGLE_GRID_SEED, adapter.mamba_split_aligns_below_cache_limit_only):
        return
    seed = EAGLE_GRID_SEED[0]
    # The stop off (the plugin's code, not vLLM's): q168 resumes from a slot cached at 128 holding 112.
    monkeypatch.setattr(mamba_split_keeps_block_grid, "block_end_stop", lambda scheduler, request, start, end: None)
    _, _, violations = soak(adapter, variant, 10_000, seed)
    assert violations == [
        "step 1633: q168: Mamba state (group 1) read at token 128: 1 wrong: block 10 holds group 1 content up to "
        "token 112, expected group 1 content up to token 128"
    ]


# A hit EAGLE ends inside a full attention block keyed by a chunk of the same step (local_hit_admission,
# full-block marks): `plugin-junction` with 32-token attention blocks, seed 2. On 0.27.1 q70 is admitted
# in the step whose chunk keys the block 96..128 it hits (128 less EAGLE's unit: 112), and its copy of
# that block runs before the forward pass writes it. (seed, steps, byte-checked loads) of the fixed
# 0.27.1 run; every wheel runs the seed clean (0.26.0 seeds 3 and 4 stopped the same way before).
FULL_BLOCK_MARK_SEED = (2, 10_005, 292)


def test_eagle_hit_inside_a_block_keyed_this_step_waits(plugin, adapter, monkeypatch):
    from hybrid_kv_plugin import scheduler_kind

    variant = _junction_fa32(adapter)
    if not soak_pinned(adapter, variant, FULL_BLOCK_MARK_SEED, adapter.version == "0.27.1"):
        return
    seed = FULL_BLOCK_MARK_SEED[0]
    # No engine marks full blocks (the plugin's code, not vLLM's): q70's copy reads zeros.
    monkeypatch.setattr(scheduler_kind, "groups_hit_inside_full_blocks", lambda scheduler: frozenset())
    _, _, violations = soak(adapter, variant, 10_000, seed)
    assert violations == [
        "step 895: q70: attention (group 0) before tokens 112..128: 1 wrong: block 1 holds zeroed, "
        "expected group 0 content up to token 112"
    ]


# A prefill whose remaining prompt keeps a junction-backport state, starved by an async load under
# Scheduler (patches/junction_reservation.py): `plugin-junction` with 32-token attention blocks,
# seed 3. On 0.28.0 vLLM's reservation kept 2 blocks for q44's remaining prefill, q46's CPU load took
# the rest, and q44's chunk 240..256 needed the block its lowered tail's state is copied into: q44
# preempted itself every step from 630 on (631 since a stored request-end state keeps its partial
# tail). (seed, steps, byte-checked loads) of the fixed 0.28.0 run; every wheel runs the seed clean.
JUNCTION_RESERVATION_SEED = (3, 10_001, 434)


def test_junction_state_is_reserved_against_async_loads(plugin, adapter, monkeypatch):
    from hybrid_kv_plugin.patches import junction_reservation

    variant = _junction_fa32(adapter)
    if not soak_pinned(adapter, variant, JUNCTION_RESERVATION_SEED, adapter.version == "0.28.0"):
        return
    seed = JUNCTION_RESERVATION_SEED[0]
    # The reservation without the owed block (the plugin's code, not vLLM's): q44 and q46 never finish.
    monkeypatch.setattr(junction_reservation, "reservation_owed_blocks", lambda manager, requests: 0)
    _, _, violations = soak(adapter, variant, 10_000, seed)
    stalled = 631  # q44 and q46 stuck from here on
    assert violations == [
        f"step {stalled + k * DRAIN_LIMIT}: not idle after {DRAIN_LIMIT} steps (['q44', 'q46'] live)" for k in (1, 2)
    ]


# An answer state handed over on what looked like a request's last step (output_checkpoint/rolling.py):
# every option on (`plugin-all-options-fa32`), AsyncScheduler, seed 13. On 0.33.0 q469 (prompt 83,
# 15 of 16 answer tokens) was preempted and recomputed from 80; its chunk 80..96 passed the old test
# (one answer token left), so the running Mamba block holding the state at 96 was handed to the
# connector, but the step computing 96..98 still came: its copy-on-write moved the block's prefix-cache
# key to the copy while the store was in flight, and vLLM's store completion asserts on the keyless
# block (step 8,351). (seed, steps, byte-checked loads) of the fixed 0.33.0 run; every wheel with the
# options runs the seed clean.
LAST_STEP_HANDOFF_SEED = (13, 10_066, 217)


@pytest.mark.parametrize("scheduling", ["async"], indirect=True)
def test_async_resumed_request_hands_over_no_state_a_later_chunk_moves(plugin, adapter, scheduling, monkeypatch):
    from hybrid_kv_plugin.output_checkpoint import rolling

    variant = _divergence_variant(adapter, "plugin-all-options-fa32")
    if variant is None:
        return
    if not soak_pinned(adapter, variant, LAST_STEP_HANDOFF_SEED, adapter.version == "0.33.0"):
        return
    # The old rule (the plugin's test, not vLLM's code): one answer token left, whatever the chunk's end.
    monkeypatch.setattr(rolling, "is_last_step", lambda request, num_tokens: request.num_output_tokens + 1 >= request.max_tokens)
    with pytest.raises(AssertionError) as failure:
        soak(adapter, variant, 10_000, LAST_STEP_HANDOFF_SEED[0])
    assert failure.traceback[-1].name == "_process_store_completion"
