"""``hybrid-kv bench``: the report's structure and its deterministic fields (timings are never asserted)."""

from __future__ import annotations

import itertools
import json

import pytest

from hybrid_kv_plugin.adapters import Feature
from hybrid_kv_plugin.sim.bench import BenchCase, run_case
from hybrid_kv_plugin.sim.replay import CONFIGS, ReplaySettings

from helpers import KEEPS_EVERY_BLOCK, STEPS, V033_STOCK, small_workload, tokens


def test_bench_times_only_scheduler_calls_and_interleaves(adapter):
    ticks = itertools.count()
    # A clock that advances one tick per reading: every timed call spans exactly one tick,
    # so a step (schedule + update_from_output) costs two, whatever the machine does.
    case = BenchCase("small", tuple(small_workload()))
    out = run_case(case, ReplaySettings(), repeats=3, clock=lambda: float(next(ticks)))
    assert (out["name"], out["requests"]) == ("small", 10)
    stock = out["configs"]["stock"]
    assert stock["step_cpu_us"] == {"min": 2e6, "median": 2e6, "max": 2e6}
    assert stock["step_floor_us"] == 2e6
    if not adapter.supports(Feature.FINE_GRAINED_CPU_HITS):
        assert set(out["configs"]["plugin"]) == {"refused"}
        assert "ratio_plugin_vs_stock" not in out and "floor_ratio_plugin_vs_stock" not in out
        return
    plugin = out["configs"]["plugin"]
    steps = STEPS[adapter.version]
    assert (stock["steps"], plugin["steps"]) == steps[:2]
    reference = KEEPS_EVERY_BLOCK[adapter.version][0] if adapter.version in KEEPS_EVERY_BLOCK else V033_STOCK
    expected_reuse = reference["reused_gpu_tokens"] + reference["reused_cpu_tokens"]
    assert (plugin["ideal_tokens"], plugin["reused_tokens"]) == (reference["ideal_tokens"], expected_reuse)
    assert plugin["efficiency"] == round(expected_reuse / reference["ideal_tokens"], 4)
    assert out["ratio_plugin_vs_stock"] == {"min": 1.0, "median": 1.0, "max": 1.0, "per_repeat": [1.0, 1.0, 1.0]}
    assert (plugin["step_floor_us"], out["floor_ratio_plugin_vs_stock"]) == (2e6, 1.0)


def test_bench_command_reports_both_cases_structure(capsys):
    from hybrid_kv_plugin.cli.main import main

    assert main(["bench", "--requests", "0", "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["repeats"] == 1
    assert report["timed"] == "process CPU time of scheduler.schedule() + scheduler.update_from_output()"
    (case,) = report["cases"]
    assert (case["name"], case["requests"]) == ("default", 31)
    assert set(case["configs"]) == {"stock", "plugin"}
    stock = case["configs"]["stock"]
    assert set(stock) == {"requests", "steps", "ideal_tokens", "reused_tokens", "efficiency", "step_cpu_us", "step_floor_us"}
    assert stock["ideal_tokens"] == 7824
    assert set(stock["step_cpu_us"]) == {"min", "median", "max"}


def _tail_case(prompt: int) -> BenchCase:
    """Request A, GPU cache evicted, then A's prompt again / A's prompt + 3 tokens (one engine each)."""
    from hybrid_kv_plugin.sim.offload_scenarios import CONTINUATION
    from hybrid_kv_plugin.sim.workload import Segment, TraceRequest

    a = tuple(tokens(prompt))

    def segment(name: str, replay: tuple[int, ...]) -> Segment:
        return Segment(
            name,
            (TraceRequest("a", 0, a, 4), TraceRequest("c", 1, replay, 1, evict_gpu_before=True)),
            eagle=False,
        )

    return BenchCase("tail", (segment("exact", a), segment("continuation", a + CONTINUATION)))


def test_bench_configs_reach_the_scheduler(adapter):
    """prompt_tail_checkpoint of a bench configuration is the scheduler's: A's prompt of 336 tokens,
    an exact replay (hit 320 with `both`, the wheel's row without) and a continuation (336 with `both`)."""
    if not adapter.prompt_tail_checkpoint_supported:
        pytest.skip("prompt_tail_checkpoint needs vLLM >= 0.29.0 (0.26-0.28 refuse replay/both at start-up)")
    ticks = itertools.count()
    configs = tuple(CONFIGS[n] for n in ("stock", "plugin", "plugin+tail-both"))
    out = run_case(_tail_case(336), ReplaySettings(), repeats=1, configs=configs, clock=lambda: float(next(ticks)))
    plugin, both = out["configs"]["plugin"], out["configs"]["plugin+tail-both"]
    assert both["ideal_tokens"] == plugin["ideal_tokens"] == 320 + 336
    # native: 0.29-0.31 keep the state at 336 only (replay 0), 0.32+ at 320 only.
    native = 320 + 320 if adapter.native_prompt_tail_keeps_replay_position else 0 + 336
    assert (plugin["reused_tokens"], both["reused_tokens"]) == (native, 320 + 336)
    # Where the wheel keeps only 336 (0.29-0.31), `both` ends A's prefill at 320 as well (one more
    # step in each segment) and the exact replay waits one step for its CPU load (natively: no hit).
    # Where it keeps only 320 (0.32+), the continuation (339 tokens) natively resumes at 320 and
    # stops a chunk at its own tail position 336; with `both` it resumes at 336: one step fewer.
    extra = -1 if adapter.native_prompt_tail_keeps_replay_position else 2 + 1
    assert both["steps"] == plugin["steps"] + extra
    assert set(out) >= {"ratio_plugin_vs_stock", "ratio_plugin+tail-both_vs_stock"}


def test_bench_command_refuses_unknown_configs(capsys):
    from hybrid_kv_plugin.cli.main import console_main

    assert console_main(["bench", "--requests", "0", "--repeats", "1", "--configs", "stock,plugin+tail-all"]) == 2
    assert capsys.readouterr().err == (
        "hybrid-kv: --configs 'stock,plugin+tail-all': allowed: stock, plugin, plugin+junction, "
        "plugin+tail-replay, plugin+tail-both, plugin+output-checkpoint\n"
    )
    assert console_main(["bench", "--requests", "0", "--repeats", "1", "--configs", "stock,stock"]) == 2
    assert capsys.readouterr().err == "hybrid-kv: --configs 'stock,stock': each configuration at most once\n"


def test_the_floor_is_each_steps_minimum_over_the_repeats():
    from hybrid_kv_plugin.sim.bench import _floor

    # Step 0 costs 3 at best, step 1 costs 5 at best: a slow repeat never moves the floor.
    assert _floor([[3.0, 9.0], [7.0, 5.0], [4.0, 6.0]]) == 4.0
    assert _floor([[2.0, 2.0]]) == 2.0
