"""Stateful randomized runs: the real scheduler + SimpleCPU connector under injected faults.

A hypothesis ``RuleBasedStateMachine`` drives :class:`~soak.harness.FaultHarness`
(the installed wheel's real ``Scheduler``, ``KVCacheManager`` and connector, through
``SimEngine``): requests from shared-prefix families arrive and run chunked prefill
and decode on a small GPU pool (preemption) with a small CPU pool (full CPU tier);
requests are aborted; the GPU prefix cache and the connector's CPU cache are reset;
the simulated worker completes transfers late and out of order and fails loads
through the wheel's own failure channel. ``StepInvariants`` is checked after every
step, the idle invariants whenever the engine drains and at the end of each example.

Each example starts from a warm CPU tier: one request per prefix family runs
(together: they preempt each other on the small GPU pool), then the GPU prefix cache
is evicted, so later requests of those families load from the CPU tier - with the
example's initial fault setting, under which loads fail where the wheel can report it.

Budget: the ``reliability-ci`` profile (deterministic: ``derandomize=True``, no
example database). ``HYBRID_KV_RELIABILITY_PROFILE=reliability-long`` runs more.
The session ends with one summary line per variant (examples, steps, requests,
invariant checks, violations). On the CI profile each variant must reach
``FLOORS``: a run that never loads, never fails a load, never preempts or never
stores a partial attention tail has not tested the invariants that guard them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from hybrid_kv_plugin.adapters import Feature, Support, select_adapter
from hybrid_kv_plugin.connector_names import STOCK_CONNECTOR_NAME
from hybrid_kv_plugin.offload.mode import OffloadMode
from hybrid_kv_plugin.sim.engine import default_scheduling

from soak.harness import (
    FAMILIES,
    MAX_LIVE_REQUESTS,
    MAX_OUTPUT_TOKENS,
    MAX_OWN_TOKENS,
    MAX_PREFIX_UNITS,
    Counts,
    HASH_BLOCK_SIZE,
    FaultHarness,
    hash_block_size_for,
    load_failures_reportable,
    variants,
)

_COMMON = dict(derandomize=True, database=None, deadline=None, print_blob=False,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
settings.register_profile("reliability-ci", max_examples=10, stateful_step_count=15, **_COMMON)
settings.register_profile("reliability-long", max_examples=200, stateful_step_count=60, **_COMMON)
# The CI budget without shrinking a failure (scripts/mutants: a killed mutant should fail fast).
settings.register_profile(
    "reliability-ci-noshrink", max_examples=10, stateful_step_count=15,
    phases=(Phase.explicit, Phase.reuse, Phase.generate), **_COMMON,
)
PROFILE = os.environ.get("HYBRID_KV_RELIABILITY_PROFILE", "reliability-ci")
CI_PROFILES = ("reliability-ci", "reliability-ci-noshrink")
# The variants this wheel offers (soak.harness.variants): an option the wheel refuses at start-up
# has no variant here; its refusal is asserted in the option's own test module.
VARIANTS = tuple(v.name for v in variants(select_adapter().adapter))
# Minimum (loads, failed loads, preemptions, partial attention tails) per variant on the CI
# profile. Failed loads only where the wheel can be told a load failed (see
# ``load_failures_reportable``); partial tails only where the attention block is coarser
# than the prefix-match unit; no preemption floor for the full-attention variant, nor where a
# variant runs on the 64-token grid (stock on 0.26-0.28): their pools, pinned by the regression
# seeds, hold the warm requests without pressure.
WARM_OWN_TOKENS = 24
# The soak's variants that combine the options (soak.harness.variants).
COMBINED_VARIANTS = ("plugin-chat-options-fa64", "plugin-all-options-fa32")
FLOORS = {"loads": 5, "failed_loads": 2, "preemptions": 1, "partial_tails": 1}


@dataclass
class Tally:
    examples: int = 0
    checks: int = 0
    violations: list[str] = field(default_factory=list)
    counts: Counts = field(default_factory=Counts)
    sides: set[str] = field(default_factory=set)  # whose SimpleCPU scheduler side ran


class _Summary:
    """Prints the per-variant totals when the session ends."""

    def __init__(self, version: str):
        self.version = version
        self.tallies: dict[str, Tally] = {}

    def pytest_terminal_summary(self, terminalreporter) -> None:
        for name, tally in self.tallies.items():
            c = tally.counts
            terminalreporter.write_line(
                f"reliability vllm {self.version} {name}: examples={tally.examples} steps={c.steps} "
                f"requests={c.requests} invariant_checks={tally.checks} violations={len(tally.violations)} "
                f"(aborts={c.aborts} preemptions={c.preemptions} loads={c.loads} failed_loads={c.failed_loads} "
                f"partial_tails={c.partial_tails} stores={c.stores} gpu_resets={c.gpu_resets} "
                f"cpu_resets={c.cpu_resets}; scheduler side {'/'.join(sorted(tally.sides))}; profile {PROFILE})"
            )


@pytest.fixture(scope="module")
def summary(request, adapter):
    plugin = _Summary(adapter.version)
    request.config.pluginmanager.register(plugin, "hybrid-kv-reliability-summary")
    return plugin


class FaultMachine(RuleBasedStateMachine):
    """One example = one engine; rules are the harness's operations."""

    adapter = None
    variant = None
    tally: Tally

    @initialize(
        seed=st.integers(0, 2**16 - 1),
        max_delay=st.sampled_from((0, 1, 3)),
        fail_rate=st.sampled_from((0.25, 0.5)),
    )
    def start(self, seed, max_delay, fail_rate):
        self.harness = FaultHarness(self.adapter, self.variant, seed=seed)
        self.tally.sides.add(self.harness.scheduler_side)
        # A warm CPU tier: every family's longest prefix stored, then evicted from the GPU.
        # 24 own tokens: the prompt's last hash boundary (272) is inside a 32-token attention block.
        for family in range(FAMILIES):
            self.harness.add(family, MAX_PREFIX_UNITS, 0, WARM_OWN_TOKENS, MAX_OUTPUT_TOKENS)
        self.harness.reset_gpu_cache()
        # Followers load the warm prefixes from the CPU tier under the example's faults.
        self.harness.set_faults(max_delay, fail_rate)
        for family in range(FAMILIES):
            self.harness.add(family, MAX_PREFIX_UNITS, 1, WARM_OWN_TOKENS, 2)

    @precondition(lambda self: len(self.harness.live()) < MAX_LIVE_REQUESTS)
    @rule(
        family=st.integers(0, FAMILIES - 1),
        prefix_units=st.integers(0, MAX_PREFIX_UNITS),
        suffix=st.integers(0, 3),
        own=st.integers(0, MAX_OWN_TOKENS),
        max_tokens=st.integers(1, MAX_OUTPUT_TOKENS),
    )
    def add(self, family, prefix_units, suffix, own, max_tokens):
        self.harness.add(family, prefix_units, suffix, own, max_tokens)

    @rule(n=st.integers(1, 8))
    def step(self, n):
        self.harness.step(n)

    @rule(pick=st.integers(0, 63))
    def abort(self, pick):
        self.harness.abort(pick)

    @rule(max_delay=st.sampled_from((0, 1, 3)), fail_rate=st.sampled_from((0.0, 0.25, 0.5)))
    def faults(self, max_delay, fail_rate):
        self.harness.set_faults(max_delay, fail_rate)

    @rule()
    def drain(self):
        self.harness.drain()

    @rule(gpu=st.booleans())
    def reset_cache(self, gpu):
        if gpu:
            self.harness.reset_gpu_cache()
        else:
            self.harness.reset_cpu_cache()

    @invariant()
    def no_violation(self):
        if hasattr(self, "harness"):
            assert self.harness.violations == []

    def teardown(self):
        if not hasattr(self, "harness"):
            return
        self.harness.finish()
        tally = self.tally
        tally.examples += 1
        tally.checks += self.harness.invariants.checks
        tally.counts.add(self.harness.counts)
        tally.violations += self.harness.violations
        assert self.harness.violations == []


def expected_side(adapter, variant) -> str:
    """The stock connector runs vLLM's stock side. The plugin's connector runs the wheel's native side
    where the wheel has the feature (0.30+); elsewhere the plugin's backport on a hybrid model and
    vLLM's stock side on a full-attention model (nothing hybrid to fix)."""
    if variant.connector == STOCK_CONNECTOR_NAME:
        return OffloadMode.STOCK.value
    if adapter.verdict(Feature.FINE_GRAINED_CPU_HITS).support is Support.NATIVE:
        return OffloadMode.NATIVE.value
    return (OffloadMode.STOCK if variant.full_attention_only else OffloadMode.BACKPORT).value


def expected_floors(adapter, variant, async_scheduling: bool = False) -> dict[str, int]:
    floors = dict(FLOORS)
    backport = expected_side(adapter, variant) == OffloadMode.BACKPORT.value
    if async_scheduling and backport and variant.output_scale > 1 and not variant.attention_block_size:
        # Known gap (issue #29): under AsyncScheduler the 0.29 backport with mamba_output_checkpoint
        # reaches few CPU-tier loads in the CI budget (0 in this release's full 0.29.0 run, 22 when the
        # file ran alone; 28 under Scheduler), with no invariant violated: lost reuse, not a wrong copy.
        floors["loads"] = 0
    if not load_failures_reportable(adapter, variant):
        floors["failed_loads"] = 0
    if variant.output_scale > 1:
        # Known gap: with its 4x answers this variant's CI budget reaches no failed load on
        # 0.31/0.32 (20 loads, 0 failed); failed loads are covered by the other variants.
        floors["failed_loads"] = 0
    if variant.name == "plugin-divergence":
        # Its CI budget reaches no failed load on 0.33 (18 loads under Scheduler, 8 under async,
        # 0 failed); its fa64 sibling reaches 18 failed of 55, and the 10,000-step soak both.
        floors["failed_loads"] = 0
    if not variant.attention_block_size or dict(variant.extra).get("cpu_tier_request_ends") == "skip":
        # No partial attention tail, or (FA32, Mamba 64) every one is a request end off the grid: declined.
        floors["partial_tails"] = 0
    if variant.full_attention_only or hash_block_size_for(adapter, variant) > HASH_BLOCK_SIZE:
        floors["preemptions"] = 0
    if (
        async_scheduling
        and variant.name
        in ("plugin-divergence", "plugin-hybrid-tier-fa64", "plugin-junction", "plugin-auto-ends-fa32")
        and expected_side(adapter, variant) == OffloadMode.NATIVE.value
    ):
        # Under AsyncScheduler an admission now waits for the running prefills' blocks
        # (admission_reserves_running_prefills), which spares these variants their CI budget's
        # preemptions on 0.30+ (0 of them; the floor of 1 held before); the other variants still
        # preempt there (0.33.0: plugin 4, plugin-output-checkpoint 21). plugin-junction (EAGLE's
        # one-block lookahead) preempts once on 0.30.0 and none on 0.31-0.33 under async.
        # plugin-auto-ends-fa32 none on 0.30-0.33 under async since a request-end state stored before the
        # tier filled keeps its partial tail (2-4 under Scheduler; its 10,000-step soak, seed 0, async: 34
        # on 0.30 and 0.31, 0 violations).
        floors["preemptions"] = 0
    if variant.name in COMBINED_VARIANTS and expected_side(adapter, variant) == OffloadMode.NATIVE.value:
        # The combined options' CI budget preempts none on 0.31-0.33 (both schedulers) nor on 0.30 under
        # async (0.30 sync: 6 and 4); their 10,000-step soaks do (0.33.0 seed 0: 98 / 123 under Scheduler,
        # 69 / 78 under async), and a preempted request's recompute is pinned by soak seed 13
        # (test_async_resumed_request_hands_over_no_state_a_later_chunk_moves).
        floors["preemptions"] = 0
    return floors


@pytest.mark.parametrize("name", VARIANTS)
def test_randomized_faults_keep_invariants(request, plugin, adapter, summary, name):
    _run_variant(adapter, summary, name, name, async_scheduling=False)


@pytest.mark.parametrize("name", VARIANTS)
def test_randomized_faults_keep_invariants_under_async_scheduling(request, plugin, adapter, summary, name):
    """The same machine on the wheel's ``AsyncScheduler`` (the engine core's batch queue, outputs a step late)."""
    with default_scheduling(True):
        _run_variant(adapter, summary, name, f"{name} async", async_scheduling=True)


def _run_variant(adapter, summary, name, label, async_scheduling):
    variant = next(v for v in variants(adapter) if v.name == name)
    tally = summary.tallies.setdefault(label, Tally())
    machine = type(f"FaultMachine[{name}]", (FaultMachine,), {"adapter": adapter, "variant": variant, "tally": tally})
    profile = settings.get_profile(PROFILE)
    run_state_machine_as_test(machine, settings=profile)
    assert tally.violations == []
    assert tally.sides == {expected_side(adapter, variant)}
    if PROFILE in CI_PROFILES:
        c = tally.counts
        reached = {"loads": c.loads, "failed_loads": c.failed_loads, "preemptions": c.preemptions, "partial_tails": c.partial_tails}
        floors = expected_floors(adapter, variant, async_scheduling)
        assert {k: v for k, v in reached.items() if v < floors[k]} == {}, f"coverage floors {floors}, reached {reached}"
        if not load_failures_reportable(adapter, variant):
            assert c.failed_loads == 0  # the wheel cannot be told: none were injected
