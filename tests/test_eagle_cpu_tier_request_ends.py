"""Under EAGLE block drop the prompt-tail Mamba state sits one prefix-match unit lower; the CPU
tier's ``cpu_tier_request_ends`` admission and ``cpu_tier_eviction: hybrid`` order must treat it
as the prompt's tail there too (offload/admission.py ``prompt_tail_start``).

Real scheduler, KV-cache manager and ``HybridSimpleCPUConnector`` of the installed wheel, EAGLE
on the trailing-unit drop. Attention block 32, Mamba block 64, unit 16. A 312-token prompt's tail
state is at 288 under EAGLE (``prompt_tail_checkpoint: replay`` on 0.29+, the wheel's own on
0.30+), off the Mamba grid; its attention partial tail is keyed at 304 (inside attention block 9)
and declined. Before the fix the admission started the tail at 304 (``(N - 1)`` floored), so it
stored the state at 288 although nothing could reach it without that partial tail: one CPU block
more, the same next-turn hit. 0.26-0.28 (no ``prompt_tail_checkpoint``, no EAGLE shift of the
native tail) keep the tail at 304, where it was always declined, and the admission's tail stays
there; their 0.29+ options are refused at start-up.
"""

from __future__ import annotations

import itertools
import random

import pytest

from hybrid_kv_plugin.config import PluginConfigError
from hybrid_kv_plugin.connector_names import CONNECTOR_NAME
from hybrid_kv_plugin.sim import HybridGeometry, SimEngine
from hybrid_kv_plugin.sim.wheel import eagle_block_drop_options

from scenarios.offload import CONTINUATION, REQUEST_ENDS_TIER_BYTES as TIER_BYTES, RequestEndsTier

# The next turn's hit from the CPU tier alone, where the wheel's own reach under EAGLE differs
# from 0.29+'s (0.26's coordinator drops no unit, test_eagle_cpu_tier_hit.py; 0.26-0.28 keep the
# tail at 304, which the dropped unit does not reach on 0.27-0.28): stored / skipped.
STORED_HIT = {"0.26.0": 304, "0.27.1": 192, "0.28.0": 256}
SKIPPED_HIT = {"0.26.0": 192, "0.27.1": 192}


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


def _geometry(adapter) -> HybridGeometry:
    return HybridGeometry(
        attention_block_size=32, eagle=True, extra_speculative_config=eagle_block_drop_options(adapter)
    )


def _engine(adapter, mode: str | None, output_checkpoint: bool = False, **extra) -> SimEngine:
    options = {} if mode is None else {"prompt_tail_checkpoint": mode}
    if output_checkpoint:
        options["mamba_output_checkpoint"] = True
    return SimEngine(
        _geometry(adapter),
        adapter=adapter,
        kv_connector=CONNECTOR_NAME,
        kv_connector_extra_config={"cpu_bytes_to_use": TIER_BYTES, **extra},
        additional_config={"hybrid_kv": options} if options else None,
    )


def _replay_mode(adapter) -> str | None:
    return "replay" if adapter.prompt_tail_checkpoint_supported else None


class Ends(RequestEndsTier):
    """The EAGLE engine whose admission records every hand-off it declines, (request id, boundary)."""

    def __init__(self, adapter, ends: str, mode: str | None):
        options = {"hybrid_kv": {"prompt_tail_checkpoint": mode}} if mode else None
        super().__init__(adapter, ends, options, geometry=_geometry(adapter))
        self.declined_handoffs: list[tuple[str, int]] = []
        admission = self.engine.connector.request_end_admission
        if admission is not None:
            filter_step = admission.filter_step

            def recording(scheduler_output):
                filter_step(scheduler_output)
                self.declined_handoffs.extend(sorted(admission.declined_this_step))

            admission.filter_step = recording


def _next_turn(adapter, ends: str, prompt_tokens: int, mode: str | None):
    """A's prompt, the GPU cache reset, A's next turn: (its hit, CPU blocks held before it, the
    hand-offs declined, (states, partial tails) declined)."""
    tier = Ends(adapter, ends, mode)
    a = tokens(prompt_tokens, seed=0)
    assert tier.request(a) == 0
    held = tier.held()
    tier.reset_gpu()
    return tier.request([*a, *CONTINUATION]), held, tier.declined_handoffs, tier.declined()


def test_eagle_is_the_schedulers_drop(plugin, adapter):
    """The connector never sees the Scheduler: the adapter reads the drop off the VllmConfig as the
    wheel's Scheduler decides it, with and without EAGLE, with and without a KV connector (0.33:
    request hashes with the drafter's lookahead prove the boundary and nothing is dropped, unless
    ``disable_lookahead_block_hashes`` or a KV connector keeps the legacy hashes). The admission's
    tail moves with it where the wheel moves its own tail (0.30+); its resume position drops a unit
    where the CPU tier's coordinator does (0.27+: 0.26 builds it without the drafter)."""
    seen, admissions = [], []
    geometries = (
        _geometry(adapter),
        HybridGeometry(attention_block_size=32, eagle=True),
        HybridGeometry(attention_block_size=32),
    )
    for geometry, connector in itertools.product(geometries, (CONNECTOR_NAME, None)):
        extra = {"cpu_bytes_to_use": TIER_BYTES} if connector else None
        engine = SimEngine(geometry, adapter=adapter, kv_connector=connector, kv_connector_extra_config=extra)
        scheduler_drops = bool(getattr(engine.scheduler, adapter.scheduler_eagle_drop_attr))
        assert adapter.scheduler_eagle_drop(engine.vllm_config) is scheduler_drops
        if connector:
            admission = engine.connector.request_end_admission
            admissions.append((admission.tail_drop, admission.resume_drop))
        seen.append(scheduler_drops)
    lookahead_hashes = adapter.hashes_lookahead_tokens
    assert seen == [True, True, True, not lookahead_hashes, False, False]
    moves_tail = adapter.native_prompt_tail_eagle_shift  # no prompt_tail_checkpoint here: the wheel's tail
    resumes_lower = adapter.version != "0.26.0"
    assert admissions == [(moves_tail, resumes_lower), (moves_tail, resumes_lower), (False, False)]


def test_skip_declines_the_eagle_prompt_tail(plugin, adapter):
    """``skip``: A's tail state (288 under EAGLE) is declined with its partial tail, and so is the
    next turn's (A + 3 new tokens: its tail is 288 again, its partial tail 304); the tier holds
    the 9 attention blocks to 288 and the state at 256 (10 blocks), and the next turn resumes at
    256; from a stored 288 it did too (no attention to reach it: the bug's 11th block). ``store``
    keeps both (12) and resumes at 288. 0.26-0.28: the same declines at 304."""
    mode = _replay_mode(adapter)
    tail = 288 if mode else 304
    assert _next_turn(adapter, "store", 312, mode) == (STORED_HIT.get(adapter.version, tail), 12, [], None)
    assert _next_turn(adapter, "skip", 312, mode) == (
        SKIPPED_HIT.get(adapter.version, 256), 10, [("r0", tail), ("r1", tail)], (2, 2)
    )


@pytest.mark.parametrize("mode", ["replay", "both"])
def test_skip_declines_both_eagle_tail_positions(plugin, adapter, mode):
    """A 336-token prompt under EAGLE hands off 304 (the replay position, 0.29-0.31) and 320 (on
    the Mamba grid: stored); from 0.32 only 320. The state at 304 is a prompt tail, declined (it was
    stored as a chunk end). The partial tail keyed at 336 is what a hit resuming at 320 reads
    under EAGLE (the lookup drops that unit), so it is stored: the next turn resumes at 320 as
    with ``store`` (before, ``skip`` declined it and the next turn hit nothing)."""
    if not adapter.prompt_tail_checkpoint_supported:
        with pytest.raises(PluginConfigError, match=rf"prompt_tail_checkpoint: '{mode}' needs vLLM >= 0\.29\.0"):
            Ends(adapter, "skip", mode)
        return
    declined = [] if adapter.native_prompt_tail_keeps_replay_position else [("r0", 304)]
    assert _next_turn(adapter, "store", 336, mode)[0] == 320
    assert _next_turn(adapter, "skip", 336, mode) == (320, 12, declined, (len(declined), 0))


def _superseded(adapter, mode: str | None, prompt_tokens: int, output_checkpoint: bool):
    """One request (40 tokens decoded) on the hybrid order: each state a deeper one supersedes,
    with whether the order demoted it, and the demoted copies published."""
    engine = _engine(adapter, mode, output_checkpoint, cpu_tier_eviction="hybrid", cpu_tier_request_ends="store")
    policy = engine.connector.cpu_tier_policy
    calls: list[tuple[int, bool]] = []
    is_intermediate = policy.is_intermediate

    def recording(request, boundary):
        answer = is_intermediate(request, boundary)
        calls.append((boundary, answer))
        return answer

    policy.is_intermediate = recording
    engine.run([("a", tokens(prompt_tokens, seed=0))], max_tokens=40)
    return calls, policy.stats["demoted"]


def test_hybrid_order_keeps_the_eagle_prompt_tail(plugin, adapter):
    """``mamba_output_checkpoint``: A (300 tokens) hands off 256 (a chunk end on the Mamba grid),
    its tail 272 (EAGLE) and an answer state per unit up to 336. The chunk end and the answer
    states 304, 320 are demoted (3), the prompt tail 272 is not. 0.26-0.28 refuse the options."""
    if not adapter.output_checkpoint_supported:
        with pytest.raises(PluginConfigError, match=r"mamba_output_checkpoint: true needs vLLM >= 0\.29\.0"):
            _engine(adapter, None, True, cpu_tier_eviction="hybrid", cpu_tier_request_ends="store")
        return
    assert _superseded(adapter, "replay", 300, True) == ([(256, True), (272, False), (304, True), (320, True)], 3)


def test_hybrid_order_keeps_both_eagle_tail_states(plugin, adapter):
    """``both`` under EAGLE on 0.29-0.31, N=336: states at 304 and 320 in one step; 320 supersedes
    304, which is a prompt tail (an exact replay's), not demoted. From 0.32 both positions are 320."""
    if not adapter.prompt_tail_checkpoint_supported:
        with pytest.raises(PluginConfigError, match=r"prompt_tail_checkpoint: 'both' needs vLLM >= 0\.29\.0"):
            _engine(adapter, "both", cpu_tier_eviction="hybrid", cpu_tier_request_ends="store")
        return
    expected = [] if adapter.native_prompt_tail_keeps_replay_position else [(304, False)]
    assert _superseded(adapter, "both", 336, False) == (expected, 0)
