"""``hybrid-kv bench``: the report's structure and its deterministic fields (timings are never asserted)."""

from __future__ import annotations

import itertools
import json

from hybrid_kv_plugin.adapters import Feature
from hybrid_kv_plugin.sim.bench import BenchCase, run_case
from hybrid_kv_plugin.sim.replay import ReplaySettings

from helpers import KEEPS_EVERY_BLOCK, STEPS, V033_STOCK, small_workload


def test_bench_times_only_scheduler_calls_and_interleaves(adapter):
    ticks = itertools.count()
    # A clock that advances one tick per reading: every timed call spans exactly one tick,
    # so a step (schedule + update_from_output) costs two, whatever the machine does.
    case = BenchCase("small", tuple(small_workload()))
    out = run_case(case, ReplaySettings(), repeats=3, clock=lambda: float(next(ticks)))
    assert (out["name"], out["requests"]) == ("small", 10)
    stock = out["configs"]["stock"]
    assert stock["step_cpu_us"] == {"min": 2e6, "median": 2e6, "max": 2e6}
    if not adapter.supports(Feature.FINE_GRAINED_CPU_HITS):
        assert set(out["configs"]["plugin"]) == {"refused"}
        assert "ratio_plugin_vs_stock" not in out
        return
    plugin = out["configs"]["plugin"]
    steps = STEPS[adapter.version]
    assert (stock["steps"], plugin["steps"]) == steps[:2]
    reference = KEEPS_EVERY_BLOCK[adapter.version][0] if adapter.version in KEEPS_EVERY_BLOCK else V033_STOCK
    expected_reuse = reference["reused_gpu_tokens"] + reference["reused_cpu_tokens"]
    assert (plugin["ideal_tokens"], plugin["reused_tokens"]) == (reference["ideal_tokens"], expected_reuse)
    assert plugin["efficiency"] == round(expected_reuse / reference["ideal_tokens"], 4)
    assert out["ratio_plugin_vs_stock"] == {"min": 1.0, "median": 1.0, "max": 1.0, "per_repeat": [1.0, 1.0, 1.0]}


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
    assert set(stock) == {"requests", "steps", "ideal_tokens", "reused_tokens", "efficiency", "step_cpu_us"}
    assert stock["ideal_tokens"] == 7824
    assert set(stock["step_cpu_us"]) == {"min", "median", "max"}
