"""Randomized fault-injection runs of SimpleCPU offload on the installed wheel's real scheduler.

:class:`FaultHarness` drives one :class:`~hybrid_kv_plugin.sim.engine.SimEngine`
with a small GPU pool (preemption), a small CPU pool (full CPU tier), a small
token budget (chunked prefill), requests from a few shared-prefix families, and
a simulated worker whose transfers complete late, out of order, or - for loads -
fail through the wheel's own failure channel. :class:`StepInvariants` is checked
after every step and :meth:`StepInvariants.check_idle` whenever the engine drains.

The hypothesis state machine in ``tests/test_reliability_statemachine.py`` calls
the harness's operations; this module's command line runs a long seeded program::

    PYTHONPATH=tests python -m soak --steps 10000                # every variant
    PYTHONPATH=tests python -m soak --steps 2000 --variant plugin --seed 7
    PYTHONPATH=tests python -m soak --steps 4000 --seed 500-509 --both-schedulers   # a sweep

and prints, per variant, the steps, requests, invariant checks and violations,
and the loads whose bytes the simulated worker verified with the byte check's own
violations (counted in the violations too; exit status 1 when any invariant was violated).
A sweep (a range of seeds, both schedulers) runs every combination, reports a run that
crashes and goes on, and closes with one ``soak sweep`` line of totals.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hybrid_kv_plugin.connector_names import CONNECTOR_NAME, STOCK_CONNECTOR_NAME
from hybrid_kv_plugin.sim.engine import SimEngine, TransferFate, TransferPolicy
from soak.step_invariants import StepInvariants
from hybrid_kv_plugin.sim.geometry import HybridGeometry

HASH_BLOCK_SIZE = 16
FAMILIES = 3
# Longest family prefix and own suffix, in tokens: a request must fit the GPU pool alone.
MAX_PREFIX_UNITS = 16
MAX_OWN_TOKENS = 64
MAX_OUTPUT_TOKENS = 12
MAX_LIVE_REQUESTS = 10
DRAIN_LIMIT = 3000


@dataclass(frozen=True)
class Variant:
    """One connector configuration the randomized runs cover."""

    name: str
    connector: str
    extra: tuple[tuple[str, Any], ...] = ()
    full_attention_only: bool = False
    # additional_config["hybrid_kv"] entries of this variant's engines.
    plugin_options: tuple[tuple[str, Any], ...] = ()
    # Multiplies every request's max_tokens (answers that cross several prefix-match units).
    output_scale: int = 1
    # Attention block coarser than the prefix-match unit (None: equal to it), so a prompt's
    # last hash boundary can fall inside an attention block (a partial attention tail).
    attention_block_size: int | None = None
    # EAGLE speculative decoding (one draft token; the draft model's attention layer joins the
    # attention group): the trailing-block drop, and under AsyncScheduler placeholder drafts.
    eagle: bool = False

    def describe(self) -> str:
        extra = ", ".join(f"{k}={v}" for k, v in self.extra)
        fa = self.attention_block_size or "16"
        shape = "full attention only" if self.full_attention_only else f"hybrid FA{fa} + Mamba64 align"
        return f"{self.connector}({extra}) on {shape}{' with EAGLE' if self.eagle else ''}"


def variants(adapter: Any) -> list[Variant]:
    """Stock and plugin connector, eager and lazy, hybrid and non-hybrid geometry.

    Where the wheel cannot serve fine-grained hits the plugin's connector only starts
    with ``fine_grained_hits: false`` (it refuses otherwise). Every supported wheel
    serves them today (0.26-0.29 through the plugin's backport). On a full-attention
    model the plugin's connector passes through to vLLM's stock SimpleCPU scheduler
    side (nothing hybrid to fix), hence that variant's name.
    """
    from hybrid_kv_plugin.adapters import Feature

    opt_out = () if adapter.supports(Feature.FINE_GRAINED_CPU_HITS) else (("fine_grained_hits", False),)
    return [
        Variant("stock", STOCK_CONNECTOR_NAME),
        Variant("plugin", CONNECTOR_NAME, opt_out),
        Variant("plugin-lazy", CONNECTOR_NAME, (*opt_out, ("lazy_offload", True))),
        # Every request end stored (the default before auto; plugin-auto-ends-fa32 runs auto here).
        Variant("plugin-fa32", CONNECTOR_NAME, (*opt_out, ("cpu_tier_request_ends", "store")), attention_block_size=32),
        Variant("passthrough-full-attention", CONNECTOR_NAME, opt_out, full_attention_only=True),
        *(
            [Variant("plugin-tail-both", CONNECTOR_NAME, opt_out, plugin_options=(("prompt_tail_checkpoint", "both"),))]
            if adapter.prompt_tail_checkpoint_supported
            else []
        ),
        *(
            [Variant("plugin-output-checkpoint", CONNECTOR_NAME, opt_out,
                     plugin_options=(("mamba_output_checkpoint", True),), output_scale=4),
             # Answer states inside a 32-token attention block (keyed and stored partial).
             Variant("plugin-output-checkpoint-fa32", CONNECTOR_NAME, opt_out, attention_block_size=32,
                     plugin_options=(("mamba_output_checkpoint", True),), output_scale=4)]
            if adapter.output_checkpoint_supported
            else []
        ),
        *(
            [Variant("plugin-divergence", CONNECTOR_NAME, opt_out, plugin_options=(("mamba_divergence_checkpoint", True),)),
             # Attention block = Mamba block (align mode's geometry): blocks keyed at every unit.
             Variant("plugin-divergence-fa64", CONNECTOR_NAME, opt_out, attention_block_size=64,
                     plugin_options=(("mamba_divergence_checkpoint", True),))]
            if adapter.divergence_checkpoint_supported
            else []
        ),
        # The junction checkpoint under EAGLE (the plugin's backport on 0.26-0.29, vLLM's own from 0.30).
        Variant("plugin-junction", CONNECTOR_NAME, opt_out, plugin_options=(("mamba_shared_prefix_checkpoint", True),),
                eagle=True),
        # The CPU tier declines request ends off the Mamba grid (states and attention partial tails).
        *(
            [Variant("plugin-skip-ends-fa32", CONNECTOR_NAME, (("cpu_tier_request_ends", "skip"),),
                     attention_block_size=32),
             # Stores request ends until the tier first evicts, declines them from then on (the default).
             Variant("plugin-auto-ends-fa32", CONNECTOR_NAME, (("cpu_tier_request_ends", "auto"),),
                     attention_block_size=32),
             # The hybrid eviction order (demoted states first while the judged bet pays), attention
             # block = Mamba block so every unit is keyed and the small CPU pool evicts often.
             Variant("plugin-hybrid-tier-fa64", CONNECTOR_NAME, (("cpu_tier_eviction", "hybrid"),),
                     attention_block_size=64)]
            if not opt_out
            else []
        ),
        *(
            # The options combined, as the README's best configurations run them: a chat workload's
            # (divergence, hybrid order, request ends skipped) with attention block = Mamba block, and every
            # option at once with 32-token attention blocks and 4x answers.
            [Variant("plugin-chat-options-fa64", CONNECTOR_NAME, (("cpu_tier_eviction", "hybrid"), ("cpu_tier_request_ends", "skip")),
                     attention_block_size=64, plugin_options=(("mamba_divergence_checkpoint", True),)),
             Variant("plugin-all-options-fa32", CONNECTOR_NAME, (("cpu_tier_eviction", "hybrid"), ("cpu_tier_request_ends", "skip")),
                     attention_block_size=32, output_scale=4,
                     plugin_options=(("mamba_divergence_checkpoint", True), ("mamba_output_checkpoint", True),
                                     ("prompt_tail_checkpoint", "both")))]
            if not opt_out and adapter.divergence_checkpoint_supported
            else []
        ),
    ]


def hash_block_size_for(adapter: Any, variant: Variant | None = None) -> int:
    """Hash-granular (16) where the variant's connector serves fine-grained hits; the Mamba block (64) elsewhere.

    Stock SimpleCPU of 0.26-0.28 asserts on a CPU hit that is not a whole scheduler
    block (``update_state_after_alloc``: ``num_external_tokens // block_size > 0``), which
    a finer prefix-match unit produces. There the stock runs use 64-token attention
    blocks and a 64-token prefix-match unit (vLLM needs every group's block size to be
    a multiple of the unit), so every hit is whole scheduler blocks; the plugin's
    hybrid variants (the backport, on the hand-off channel it adds) run hash-granular.
    The full-attention variant keeps the 64 grid there: the feature does not touch it,
    and at 16 its seed-0 program stalls the stock 0.26/0.28 scheduler (the requests of
    0.29's deadlock seed stay waiting; no plugin patch is involved), a separate issue.
    """
    from hybrid_kv_plugin.adapters import Feature

    if not adapter.supports(Feature.FINE_GRAINED_CPU_HITS):
        return HybridGeometry().mamba_block_size
    on_grid = variant is not None and (variant.connector == STOCK_CONNECTOR_NAME or variant.full_attention_only)
    return HybridGeometry().mamba_block_size if on_grid and adapter.boundary_handoff_patch_needed else HASH_BLOCK_SIZE


def load_failures_reportable(adapter: Any, variant: Variant) -> bool:
    """Whether the wheel's scheduler can be told a load failed for this geometry."""
    return adapter.kv_load_failure_by_request or variant.full_attention_only


@dataclass
class Faults:
    """The simulated worker's current behaviour (changed by ``FaultHarness.set_faults``)."""

    max_delay: int = 0  # each transfer completes 0..max_delay steps late (so out of order)
    fail_rate: float = 0.0  # probability that a load fails (only where reportable)


@dataclass
class Counts:
    steps: int = 0
    requests: int = 0
    aborts: int = 0
    preemptions: int = 0
    loads: int = 0
    failed_loads: int = 0
    stores: int = 0
    gpu_resets: int = 0
    cpu_resets: int = 0
    drains: int = 0
    # Attention blocks stored while holding a partial prefix key (a prompt's last hash
    # boundary inside the block).
    partial_tails: int = 0
    # The simulated worker's byte check (sim/byte_cache.py): loads whose bytes it
    # verified, and its violations (also in ``FaultHarness.violations``).
    byte_checked_loads: int = 0
    byte_violations: int = 0
    # Mamba states the geometry's off-grid chunking left stale (sim/byte_cache.py).
    byte_off_grid_mamba_states: int = 0

    def add(self, other: Counts) -> None:
        for name in vars(self):
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class FaultHarness:
    adapter: Any
    variant: Variant
    seed: int = 0
    num_gpu_blocks: int = 40
    cpu_blocks: int = 48
    max_num_batched_tokens: int = 128
    # vLLM's own choice for a failed load: "recompute" (the request recomputes what it
    # could not load) or "fail" (the request ends with an error).
    load_failure_policy: str = "recompute"
    # additional_config["hybrid_kv"] of the engine (e.g. {"async_load_liveness": False}).
    plugin_options: dict[str, Any] = field(default_factory=dict)
    faults: Faults = field(default_factory=Faults)
    counts: Counts = field(default_factory=Counts)
    # The simulated worker's byte check (sim/byte_cache.py); None: where the simulator models the wheel.
    byte_check: bool | None = None

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.can_fail_loads = load_failures_reportable(self.adapter, self.variant)
        unit = hash_block_size_for(self.adapter, self.variant)
        if self.variant.attention_block_size:
            # The same pool in tokens as the unit-sized geometry, so it still preempts.
            self.num_gpu_blocks = self.num_gpu_blocks * unit // self.variant.attention_block_size
        geometry = HybridGeometry(
            attention_block_size=self.variant.attention_block_size or unit,
            hash_block_size=unit,
            num_gpu_blocks=self.num_gpu_blocks,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=8,
            max_model_len=1024,
            full_attention_only=self.variant.full_attention_only,
            eagle=self.variant.eagle,
        )
        self.engine = SimEngine(
            geometry,
            adapter=self.adapter,
            kv_connector=self.variant.connector,
            kv_connector_extra_config={"cpu_bytes_to_use": self.cpu_blocks * geometry.attention_page_bytes, **dict(self.variant.extra)},
            additional_config=self._additional_config(),
            transfer_policy=TransferPolicy(fate=self._fate),
            configure=self._configure,
            byte_check=self.byte_check,
        )
        self.invariants = StepInvariants(self.engine)
        self._stores_seen = 0
        self._ids = 0
        self._preemptions: dict[str, int] = {}
        self._families = [[random.Random(1000 + f).randint(1, 1000) for _ in range(MAX_PREFIX_UNITS * HASH_BLOCK_SIZE)] for f in range(FAMILIES)]

    def _additional_config(self) -> dict[str, Any] | None:
        options = {**dict(self.variant.plugin_options), **self.plugin_options}
        return {"hybrid_kv": options} if options else None

    def _configure(self, vllm_config: Any) -> None:
        vllm_config.kv_transfer_config.kv_load_failure_policy = self.load_failure_policy

    # ------------------------------------------------------------------ the simulated worker
    def _fate(self, kind: str, payload: Any) -> TransferFate:
        delay = self.rng.randint(0, self.faults.max_delay) if self.faults.max_delay else 0
        fail = kind == "load" and self.can_fail_loads and self.rng.random() < self.faults.fail_rate
        if kind == "load":
            self.counts.loads += 1
            self.counts.failed_loads += fail
        else:
            self.counts.stores += 1
        return TransferFate(extra_delay=delay, fail=fail)

    def set_faults(self, max_delay: int, fail_rate: float) -> None:
        self.faults = Faults(max_delay=max_delay, fail_rate=fail_rate if self.can_fail_loads else 0.0)

    # ------------------------------------------------------------------ operations
    def prompt(self, family: int, prefix_units: int, variant: int, own_tokens: int) -> list[int]:
        """A family prefix plus an own suffix; equal arguments give equal prompts (exact replays)."""
        prefix = self._families[family % FAMILIES][: prefix_units * HASH_BLOCK_SIZE]
        own = random.Random(f"{family}/{variant}").choices(range(1, 1001), k=own_tokens)
        prompt = prefix + own
        return prompt or [1]

    def add(self, family: int, prefix_units: int, variant: int, own_tokens: int, max_tokens: int) -> str:
        req_id = f"q{self._ids}"
        self._ids += 1
        prompt = self.prompt(family, prefix_units, variant, own_tokens)
        self.engine.add_request(req_id, prompt, max_tokens=max_tokens * self.variant.output_scale)
        self.counts.requests += 1
        return req_id

    def live(self) -> list[str]:
        return sorted(r for r, req in self.engine.scheduler.requests.items() if not req.is_finished())

    def abort(self, pick: int) -> str | None:
        live = self.live()
        if not live:
            return None
        req_id = live[pick % len(live)]
        self.engine.abort([req_id])
        self.counts.aborts += 1
        return req_id

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.engine.step()
            self.counts.steps += 1
            self._count_preemptions()
            self._count_partial_tails()
            self.invariants.check_step()

    def _count_preemptions(self) -> None:
        for req_id, request in self.engine.scheduler.requests.items():
            before = self._preemptions.get(req_id, 0)
            if request.num_preemptions > before:
                self.counts.preemptions += request.num_preemptions - before
                self._preemptions[req_id] = request.num_preemptions

    def _count_partial_tails(self) -> None:
        offload = self.invariants.offload
        if offload is None:
            return
        new = offload.stores[self._stores_seen :]
        self._stores_seen = len(offload.stores)
        self.counts.partial_tails += sum(offload.is_partial_attention_store(r) for r in new)

    @property
    def scheduler_side(self) -> str:
        """Whose SimpleCPU scheduler side runs: "backport" (the plugin's), "native" or "stock" (vLLM's)."""
        mode = getattr(self.engine.connector, "offload_mode", None)
        return "stock" if mode is None else mode.value

    def drain(self) -> bool:
        """Step until idle (faults stay on); check the idle invariants. False if it never idled."""
        self.counts.drains += 1
        for _ in range(DRAIN_LIMIT):
            if not self.engine.has_work():
                self.invariants.check_idle()
                return True
            self.step()
        self.invariants.violations.append(
            f"step {len(self.engine.steps)}: not idle after {DRAIN_LIMIT} steps ({self.live()} live)"
        )
        return False

    def reset_gpu_cache(self) -> None:
        """Drain, then evict the GPU prefix cache (only possible with nothing referenced)."""
        if self.drain():
            if not self.engine.reset_prefix_cache():
                self.invariants.violations.append(f"step {len(self.engine.steps)}: idle, but the GPU cache reset failed")
            self.counts.gpu_resets += 1

    def reset_cpu_cache(self) -> None:
        """Reset the connector's CPU cache now, in-flight transfers and all (the engine's own call)."""
        self.engine.scheduler.reset_connector_cache()
        self.invariants.stats_reset()
        self.counts.cpu_resets += 1

    def finish(self) -> None:
        """Drain with faults off, so that a run always ends on the idle checks."""
        self.faults = Faults()
        self.drain()

    @property
    def violations(self) -> list[str]:
        byte_cache = self.engine.byte_cache
        return self.invariants.violations + (byte_cache.violations if byte_cache is not None else [])

    def count_byte_check(self) -> None:
        byte_cache = self.engine.byte_cache
        if byte_cache is not None:
            self.counts.byte_checked_loads = byte_cache.stats.loads
            self.counts.byte_violations = len(byte_cache.violations)
            self.counts.byte_off_grid_mamba_states = byte_cache.stats.off_grid_mamba_states


# ---------------------------------------------------------------------- the soak program
def random_program(harness: FaultHarness, steps: int, rng: random.Random) -> None:
    """Random operations until ``steps`` engine steps have run."""
    while harness.counts.steps < steps and not harness.violations:
        roll = rng.random()
        if roll < 0.30 and len(harness.live()) < MAX_LIVE_REQUESTS:
            harness.add(
                rng.randrange(FAMILIES),
                rng.randint(0, MAX_PREFIX_UNITS),
                rng.randrange(4),
                rng.randint(0, MAX_OWN_TOKENS),
                rng.randint(1, MAX_OUTPUT_TOKENS),
            )
        elif roll < 0.34:
            harness.abort(rng.randrange(64))
        elif roll < 0.38:
            harness.set_faults(rng.choice((0, 0, 1, 3)), rng.choice((0.0, 0.0, 0.25, 0.5)))
        elif roll < 0.40:
            harness.reset_gpu_cache()
        elif roll < 0.42:
            harness.reset_cpu_cache()
        elif roll < 0.45:
            harness.drain()
        else:
            harness.step(rng.randint(1, 8))
    harness.finish()
    harness.count_byte_check()


def soak(
    adapter: Any, variant: Variant, steps: int, seed: int, plugin_options: dict[str, Any] | None = None
) -> tuple[Counts, int, list[str]]:
    harness = FaultHarness(adapter, variant, seed=seed, plugin_options=dict(plugin_options or {}))
    random_program(harness, steps, random.Random(seed))
    return harness.counts, harness.invariants.checks, harness.violations


def soak_clean(adapter: Any, variant: Variant, seed: int, steps: int = 10_000) -> Counts:
    """A soak that must report nothing (no violation, byte check clean, every step run); its counts."""
    counts, _, violations = soak(adapter, variant, steps, seed)
    assert violations == [] and counts.byte_violations == 0 and counts.steps >= steps, violations[:3]
    return counts


def soak_pinned(adapter: Any, variant: Variant, pin: tuple[int, int, int], pinned_here: bool) -> bool:
    """Run ``pin``'s seed (seed, steps, byte-checked loads) clean; where ``pinned_here``, also to exactly
    those figures. Returns ``pinned_here`` (a regression test ablates its fix only there)."""
    seed, steps, checked_loads = pin
    counts = soak_clean(adapter, variant, seed)
    if pinned_here:
        assert (counts.steps, counts.byte_checked_loads) == (steps, checked_loads)
    return pinned_here


def seed_range(text: str) -> range:
    """``N`` or an inclusive ``FROM-TO`` (argparse type of ``--seed``)."""
    low, sep, high = text.partition("-")
    try:
        seeds = range(int(low), int(high if sep else low) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a seed or a FROM-TO range of seeds: {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError(f"empty range of seeds: {text!r} (FROM must not exceed TO)")
    return seeds


@dataclass
class SweepTotals:
    """What every run of one command found, for the closing line of a sweep."""

    runs: int = 0
    violating: int = 0
    crashed: int = 0
    byte_checked_loads: int = 0
    byte_violations: int = 0

    def line(self, version: str) -> str:
        return (
            f"soak sweep vllm {version}: runs={self.runs} violating={self.violating} crashed={self.crashed} "
            f"byte_checked_loads={self.byte_checked_loads} byte_violations={self.byte_violations}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10_000, help="engine steps per variant (default 10000)")
    parser.add_argument(
        "--seed", type=seed_range, default=range(1),
        help="seed, or an inclusive range FROM-TO: one run each (default 0)",
    )
    parser.add_argument("--variant", action="append", help="variant name (default: all)")
    schedulers = parser.add_mutually_exclusive_group()
    schedulers.add_argument(
        "--async-scheduling", action="store_true", help="engine core as under AsyncScheduler (GPU vllm serve's default)"
    )
    schedulers.add_argument(
        "--both-schedulers", action="store_true", help="each run under Scheduler, then under AsyncScheduler"
    )
    args = parser.parse_args(argv)

    import hybrid_kv_plugin
    from hybrid_kv_plugin.registration import STATE, Status
    from hybrid_kv_plugin.sim.engine import default_scheduling

    hybrid_kv_plugin.register()
    if STATE.status is not Status.ACTIVE:
        print(f"hybrid-kv soak: the plugin is not active here ({STATE.status}: {STATE.reason})", file=sys.stderr)
        return 2
    adapter = STATE.adapter
    chosen = [v for v in variants(adapter) if not args.variant or v.name in args.variant]
    if not chosen:
        parser.error(f"no such variant; known: {', '.join(v.name for v in variants(adapter))}")
    modes = (False, True) if args.both_schedulers else (args.async_scheduling,)
    totals = SweepTotals()
    for seed in args.seed:
        for variant in chosen:
            for asynchronous in modes:
                totals.runs += 1
                _run_one(adapter, variant, args.steps, seed, asynchronous, default_scheduling, totals)
    if totals.runs > 1:
        print(totals.line(adapter.version), flush=True)
    return 1 if totals.violating or totals.crashed else 0


def _run_one(
    adapter: Any, variant: Variant, steps: int, seed: int, asynchronous: bool, scheduling: Any, totals: SweepTotals
) -> None:
    """One seeded run: its summary line, its violations (a crash is a finding too: the sweep goes on)."""
    started = time.monotonic()
    scheduler = "AsyncScheduler" if asynchronous else "Scheduler"
    try:
        with scheduling(asynchronous):
            counts, checks, violations = soak(adapter, variant, steps, seed)
    except Exception as error:  # noqa: BLE001 - reported, counted and the exit status says so
        totals.crashed += 1
        print(f"soak vllm {adapter.version} {variant.name}: crashed (seed {seed}; {scheduler}): {error!r}", flush=True)
        traceback.print_exc()
        return
    totals.violating += bool(violations)
    totals.byte_checked_loads += counts.byte_checked_loads
    totals.byte_violations += counts.byte_violations
    print(
        f"soak vllm {adapter.version} {variant.name}: steps={counts.steps} requests={counts.requests} "
        f"invariant_checks={checks} violations={len(violations)} byte_checked_loads={counts.byte_checked_loads} "
        f"byte_violations={counts.byte_violations} byte_off_grid_mamba_states={counts.byte_off_grid_mamba_states} "
        f"| aborts={counts.aborts} "
        f"preemptions={counts.preemptions} loads={counts.loads} failed_loads={counts.failed_loads} "
        f"stores={counts.stores} gpu_resets={counts.gpu_resets} cpu_resets={counts.cpu_resets} "
        f"(seed {seed}; {scheduler}; PYTHONHASHSEED={os.environ.get('PYTHONHASHSEED', 'unset')}; "
        f"{time.monotonic() - started:.1f} s; {variant.describe()})",
        flush=True,
    )
    for line in violations[:20]:
        print(f"  violation: {line}")
