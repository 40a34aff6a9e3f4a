"""prompt_tail_checkpoint (native / replay / both) on every wheel, with the real scheduler.

Request A (4 output tokens), GPU prefix cache evicted, then request C: A's prompt
again (exact replay) or A's prompt + 3 tokens (continuation). C's hit is served by
the CPU tier through HybridSimpleCPUConnector. Geometries: FA 16 + Mamba 64 align,
prefix-match unit 16 (the issue's); FA 16 + Mamba 128; and the first one with
``max_num_batched_tokens`` 128, so a prompt is prefilled in several chunks.
"""

from __future__ import annotations

import pytest

from hybrid_kv_plugin.config import PluginConfigError
from hybrid_kv_plugin.sim import HybridGeometry, SimEngine
from hybrid_kv_plugin.sim.wheel import eagle_block_drop_options

from helpers import tokens
from scenarios.prompt_tail import CONTINUED, EXACT, cold_replay, gpu_replay, tail_engine

PROMPTS = (320, 336, 368, 496)
MAMBA64 = HybridGeometry()
MAMBA128 = HybridGeometry(mamba_block_size=128)
CHUNKED = HybridGeometry(max_num_batched_tokens=128)
GEOMETRIES = {"fa16-mamba64": MAMBA64, "fa16-mamba128": MAMBA128, "fa16-mamba64-chunk128": CHUNKED}

# The last hash boundary <= N-1 (exact replays land there) and <= N (continuations).
REPLAY_ROW = [304, 320, 352, 480]
PROMPT_ROW = [320, 336, 368, 496]
OLD_WHEELS = ("0.29.0", "0.30.0", "0.31.0")
NEW_WHEELS = ("0.32.0", "0.33.0")
# 0.26-0.28 refuse replay/both; their native rows are asserted as well (0.26/0.27 keep
# Mamba block ends of an exact replay, 0.28 keeps none: the 0.29-0.31 row).
OLDEST_WHEELS = ("0.26.0", "0.27.1")
# The wheel's own rows (the table); a chunked prompt loses its last chunk on 0.28-0.31.
NATIVE = {
    "fa16-mamba64": {
        **{v: {EXACT: [0, 320, 320, 448], CONTINUED: PROMPT_ROW} for v in OLDEST_WHEELS},
        **{v: {EXACT: [0, 0, 0, 0], CONTINUED: PROMPT_ROW} for v in ("0.28.0", *OLD_WHEELS)},
        **{v: {EXACT: REPLAY_ROW, CONTINUED: [320, 320, 352, 480]} for v in NEW_WHEELS},
    },
    "fa16-mamba64-chunk128": {
        **{v: {EXACT: [256, 320, 320, 448], CONTINUED: PROMPT_ROW} for v in OLDEST_WHEELS},
        **{v: {EXACT: [256, 256, 256, 384], CONTINUED: PROMPT_ROW} for v in ("0.28.0", *OLD_WHEELS)},
        **{v: {EXACT: REPLAY_ROW, CONTINUED: [320, 320, 352, 480]} for v in NEW_WHEELS},
    },
}
# replay = the 0.33 row everywhere (with Mamba 128 the state at 320 is no block end: 304).
REPLAY = {
    "fa16-mamba64": {EXACT: REPLAY_ROW, CONTINUED: [320, 320, 352, 480]},
    "fa16-mamba128": {EXACT: REPLAY_ROW, CONTINUED: REPLAY_ROW},
    "fa16-mamba64-chunk128": {EXACT: REPLAY_ROW, CONTINUED: [320, 320, 352, 480]},
}
BOTH = {EXACT: REPLAY_ROW, CONTINUED: PROMPT_ROW}


def _supported(adapter) -> bool:
    return adapter.prompt_tail_checkpoint_supported


def _refused_here(adapter, mode: str = "both", geometry: HybridGeometry | None = None) -> bool:
    """On a wheel without replay/both, building with ``mode`` stops start-up (asserted): True, nothing more to run."""
    if _supported(adapter):
        return False
    with pytest.raises(PluginConfigError, match=rf"hybrid_kv\.prompt_tail_checkpoint: '{mode}' needs vLLM >= 0\.29\.0"):
        tail_engine(adapter, mode, geometry)
    return True


def _row(adapter, mode: str, kind: str, geometry: HybridGeometry) -> list[int]:
    return [cold_replay(adapter, mode, tokens(n), kind, geometry).hit for n in PROMPTS]


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_both_serves_exact_replays_and_continuations(plugin, adapter, geometry):
    if _refused_here(adapter, "both", GEOMETRIES[geometry]):
        return
    assert _row(adapter, "both", EXACT, GEOMETRIES[geometry]) == BOTH[EXACT]
    assert _row(adapter, "both", CONTINUED, GEOMETRIES[geometry]) == BOTH[CONTINUED]


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_replay_is_the_0_33_position(plugin, adapter, geometry):
    if _refused_here(adapter, "replay", GEOMETRIES[geometry]):
        return
    assert _row(adapter, "replay", EXACT, GEOMETRIES[geometry]) == REPLAY[geometry][EXACT]
    assert _row(adapter, "replay", CONTINUED, GEOMETRIES[geometry]) == REPLAY[geometry][CONTINUED]


@pytest.mark.parametrize("geometry", sorted(NATIVE))
def test_native_is_the_wheel_row(plugin, adapter, geometry):
    expected = NATIVE[geometry][adapter.version]
    assert _row(adapter, "native", EXACT, GEOMETRIES[geometry]) == expected[EXACT]
    assert _row(adapter, "native", CONTINUED, GEOMETRIES[geometry]) == expected[CONTINUED]


def _schedule(engine: SimEngine, n: int) -> list[dict[str, int]]:
    engine.run([("a", tokens(n))], max_tokens=4)
    return [step.num_scheduled_tokens for step in engine.steps]


def test_native_schedules_like_stock(adapter):
    """native: the same chunks and the same GPU hits as the wheel without the plugin."""
    import hybrid_kv_plugin

    def schedules_and_hits():
        out = []
        for n in PROMPTS:
            engine = SimEngine(CHUNKED, adapter=adapter, additional_config={"hybrid_kv": {"prompt_tail_checkpoint": "native"}})
            out.append((_schedule(engine, n), engine.run([("b", tokens(n))])["b"]))
        return out

    hybrid_kv_plugin.uninstall()
    stock = schedules_and_hits()
    hybrid_kv_plugin.register()
    try:
        assert schedules_and_hits() == stock
    finally:
        hybrid_kv_plugin.uninstall()


# Cost on FA 16 + Mamba 64 (prompts 320, 336, 368, 496): prefill steps of A, and the
# Mamba states it leaves cached on the GPU (= stored on the CPU tier).
COST = {
    "native": {
        **{v: ([1, 2, 2, 2], [1, 2, 2, 2]) for v in OLDEST_WHEELS},
        "0.28.0": ([1, 1, 1, 1], [1, 1, 1, 1]),
        **{v: ([1, 1, 1, 1], [1, 1, 1, 1]) for v in OLD_WHEELS},
        **{v: ([2, 2, 2, 2], [2, 1, 1, 1]) for v in NEW_WHEELS},
    },
    "replay": {v: ([2, 2, 2, 2], [2, 1, 1, 1]) for v in OLD_WHEELS + NEW_WHEELS},
    "both": {v: ([2, 2, 2, 2], [2, 2, 2, 2]) for v in OLD_WHEELS + NEW_WHEELS},
}


@pytest.mark.parametrize("mode", sorted(COST))
def test_cost_steps_and_states(plugin, adapter, mode):
    if mode != "native" and _refused_here(adapter, mode):
        return
    runs = [cold_replay(adapter, mode, tokens(n), CONTINUED) for n in PROMPTS]
    steps, states = COST[mode][adapter.version]
    assert [r.prefill_steps for r in runs] == steps
    assert [r.mamba_states for r in runs] == states
    # The connector stores each kept state once: no double store.
    assert [r.mamba_stored for r in runs] == states


def test_other_values_stop_start_up(plugin, adapter):
    for bad in ("Both", "none", True, 1, None):
        with pytest.raises(PluginConfigError) as refused:
            tail_engine(adapter, bad)
        assert str(refused.value) == (
            "invalid hybrid-kv-plugin configuration: hybrid_kv.prompt_tail_checkpoint: Input should be "
            f"'native', 'replay' or 'both' (got {bad!r}; allowed: native, replay or both)"
        )


def test_old_wheels_refuse_non_native(plugin, adapter):
    if _supported(adapter):
        # 0.29+: the value is accepted and bound to the scheduler and its align Mamba managers.
        run = tail_engine(adapter, "both")
        run.request(tokens(336), max_tokens=1)
        from hybrid_kv_plugin.prompt_tail.binding import MANAGER_POLICY_ATTR, SCHEDULER_POLICY_ATTR

        policy = getattr(run.engine.scheduler, SCHEDULER_POLICY_ATTR)
        assert (policy.mode, sorted(policy.kept(336))) == ("both", [320, 336])
        managers = run.engine.scheduler.kv_cache_manager.coordinator.single_type_managers
        assert [getattr(m, MANAGER_POLICY_ATTR, None) is policy for m in managers] == [True, True]
        return
    for value in ("replay", "both"):
        with pytest.raises(PluginConfigError) as refused:
            tail_engine(adapter, value)
        assert str(refused.value) == (
            f"invalid hybrid-kv-plugin configuration: hybrid_kv.prompt_tail_checkpoint: {value!r} needs "
            f"vLLM >= 0.29.0 and this is vLLM {adapter.version} (allowed here: native)"
        )


# EAGLE with block drop (0.33: lookahead hashes off): the drafter drops the last matched
# unit, so both positions move one unit down; from 0.32 an exact replay's lookup reaches
# the continuation position, so one state serves both kinds there.
EAGLE_BOTH = {
    **{v: {EXACT: [288, 304, 336, 464], CONTINUED: [304, 320, 352, 480]} for v in OLD_WHEELS},
    **{v: {EXACT: [304, 320, 352, 480], CONTINUED: [304, 320, 352, 480]} for v in NEW_WHEELS},
}


def test_both_under_eagle_shifts_as_the_wheel_does(plugin, adapter):
    geometry = HybridGeometry(eagle=True, extra_speculative_config=eagle_block_drop_options(adapter))
    if _refused_here(adapter, "both", geometry):
        return
    assert _row(adapter, "both", EXACT, geometry) == EAGLE_BOTH[adapter.version][EXACT]
    assert _row(adapter, "both", CONTINUED, geometry) == EAGLE_BOTH[adapter.version][CONTINUED]


# The real engine's geometry (tests/engine: attention block 32; align mode sets the Mamba
# block to it; prefix-match unit 16; vLLM's default prefix_cache_retention_interval 0).
ENGINE = HybridGeometry(
    attention_block_size=32, mamba_block_size=32, hash_block_size=16, prefix_cache_retention_interval=0
)
ENGINE_PROMPTS = (336, 448)
# (exact, continuation) per prompt, served from the CPU tier after a GPU reset, on every
# wheel 0.29-0.33. 448 is a Mamba block end: its state at N is a full block, which
# retention 0 keeps only because patch prompt_tail_retention (0.30+) names it (before:
# continuation 432 on 0.30-0.33). 336 and 432 lie inside a 32-token attention block, which
# the wheel keys at one tail position only; patch prompt_tail_attention keys the other
# (before: continuation of 336 -> 320 on 0.32+, exact replay of 448 -> 0 on 0.29-0.31).
# 0.29 (no replay_boundaries, no retention patch yet) still loses the block at 448: 432.
# native on 0.32+: the <= N-1 state serves both kinds.
ENGINE_BOTH = {336: (320, 336), 448: (432, 448)}
ENGINE_NATIVE_NEW = {336: (320, 320), 448: (432, 432)}
# The wheel alone at the engine geometry: 0.26-0.28 keep N (their exact replay of 448 finds
# nothing: the lookup stops one unit short of the block end it needs), 0.29-0.31 keep no
# state at the block end 448 under retention 0.
ENGINE_NATIVE = {
    **{v: {336: (320, 336), 448: (0, 448)} for v in (*OLDEST_WHEELS, "0.28.0")},
    **{v: {336: (320, 336), 448: (0, 0)} for v in OLD_WHEELS},
    **{v: ENGINE_NATIVE_NEW for v in NEW_WHEELS},
}


def test_engine_geometry_both(plugin, adapter):
    if _refused_here(adapter, "both", ENGINE):
        return
    measured = {n: tuple(cold_replay(adapter, "both", tokens(n), kind, ENGINE).hit for kind in (EXACT, CONTINUED))
                for n in ENGINE_PROMPTS}
    on_grid_continuation = 448 if adapter.mamba_retention_keeps_replay_boundaries else 432
    assert measured == {**ENGINE_BOTH, 448: (432, on_grid_continuation)}


def test_engine_geometry_native(plugin, adapter):
    measured = {n: tuple(cold_replay(adapter, "native", tokens(n), kind, ENGINE).hit for kind in (EXACT, CONTINUED))
                for n in ENGINE_PROMPTS}
    assert measured == ENGINE_NATIVE[adapter.version]


# With A's blocks still on the GPU: (hit, the part of it the CPU tier added) per kind. The
# wheel's GPU lookup stops one unit short of some sub-block states the connector then
# completes (0.32 native 448: (432, 16) too).
ENGINE_BOTH_GPU = {336: ((320, 0), (336, 16)), 448: ((432, 16), (448, 0))}


def test_engine_geometry_both_without_a_gpu_reset(plugin, adapter):
    """The continuation at N = 448 is served by the GPU prefix cache alone (nothing from the CPU tier)."""
    if _refused_here(adapter, "both", ENGINE):
        return
    measured = {n: tuple(gpu_replay(adapter, "both", tokens(n), kind, ENGINE) for kind in (EXACT, CONTINUED))
                for n in ENGINE_PROMPTS}
    if adapter.mamba_retention_keeps_replay_boundaries:
        assert measured == ENGINE_BOTH_GPU
    else:
        assert measured == {**ENGINE_BOTH_GPU, 448: ((432, 16), (432, 16))}
