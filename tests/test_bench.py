"""``hybrid-kv bench``: the report's structure and its deterministic fields (timings are never asserted)."""

from __future__ import annotations

import functools
import itertools
import json

import pytest

from hybrid_kv_plugin.adapters import Feature
from hybrid_kv_plugin.sim.bench import BenchCase, run_case
from hybrid_kv_plugin.sim.configs import CONFIGS
from hybrid_kv_plugin.sim.replay import ReplaySettings

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


def _bench_children() -> list[int]:
    """Processes this one started that are still there (the bench's configuration processes)."""
    import psutil  # a vLLM dependency

    return sorted(p.pid for p in psutil.Process().children(recursive=True))


@pytest.mark.parametrize("in_process", [False, True], ids=["processes", "in-process"])
def test_bench_command_reports_both_cases_structure(capsys, in_process, adapter):
    from hybrid_kv_plugin.cli.main import main

    before = _bench_children()
    args = ["bench", "--requests", "0", "--repeats", "1", "--json"] + (["--in-process"] if in_process else [])
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["repeats"] == 1
    assert report["timed"] == "process CPU time of scheduler.schedule() + scheduler.update_from_output()"
    assert report["processes"] == ("this one" if in_process else "one per configuration")
    assert report["scheduler"] == "Scheduler"
    (case,) = report["cases"]
    assert (case["name"], case["requests"]) == ("default", 31)
    # The default configurations: stock, the plugin, and the plugin with its divergence option,
    # which 0.26-0.28 refuse at start-up (a row, no run, no ratio).
    assert set(case["configs"]) == {"stock", "plugin", "plugin+divergence"}
    if adapter.divergence_checkpoint_supported:
        assert case["configs"]["plugin+divergence"]["ideal_tokens"] == 7824
        assert "ratio_plugin+divergence_vs_stock" in case
    else:
        assert case["configs"]["plugin+divergence"]["refused"].endswith("(allowed here: false)")
        assert "ratio_plugin+divergence_vs_stock" not in case
    stock = case["configs"]["stock"]
    assert set(stock) == {"requests", "steps", "ideal_tokens", "reused_tokens", "efficiency", "step_cpu_us", "step_floor_us"}
    assert stock["ideal_tokens"] == 7824
    assert set(stock["step_cpu_us"]) == {"min", "median", "max"}
    # The configuration processes are gone afterwards.
    assert _bench_children() == before


def test_bench_command_drives_the_async_scheduler_on_request(capsys, adapter):
    """``--async-scheduling``: every configuration process runs vLLM's AsyncScheduler (its steps are the
    in-process async count's, not Scheduler's), and the report says so."""
    from hybrid_kv_plugin.cli.main import main

    before = _bench_children()
    assert main(["bench", "--requests", "0", "--repeats", "1", "--configs", "stock,plugin", "--async-scheduling"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.endswith("processes: one per configuration, vLLM's AsyncScheduler")
    assert main(["bench", "--requests", "0", "--repeats", "1", "--configs", "stock,plugin", "--async-scheduling", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["scheduler"] == "AsyncScheduler"
    (case,) = report["cases"]
    for name in ("stock", "plugin"):
        counted = _default_workload_count(name, True)
        assert counted is not None and case["configs"][name]["steps"] == counted[1]
    assert case["configs"]["stock"]["steps"] == STOCK_STEPS[True].get(adapter.version, 132)
    assert _bench_children() == before


def _tail_case(prompt: int) -> BenchCase:
    """Request A, GPU cache evicted, then A's prompt again / A's prompt + 3 tokens (one engine each)."""
    from hybrid_kv_plugin.sim.workload import Segment, TraceRequest
    from scenarios.offload import CONTINUATION

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
    ticks = itertools.count()
    configs = tuple(CONFIGS[n] for n in ("stock", "plugin", "plugin+tail-both"))
    out = run_case(_tail_case(336), ReplaySettings(), repeats=1, configs=configs, clock=lambda: float(next(ticks)))
    plugin, both = out["configs"]["plugin"], out["configs"]["plugin+tail-both"]
    if not adapter.prompt_tail_checkpoint_supported:  # 0.26-0.28: the plugin's start-up refusal, no run
        assert both == {
            "refused": "invalid hybrid-kv-plugin configuration: hybrid_kv.prompt_tail_checkpoint: 'both' needs "
            f"vLLM >= 0.29.0 and this is vLLM {adapter.version} (allowed here: native)"
        }
        # 0.26/0.27 keep every Mamba block on their own (stock 640 of 656), 0.28 none at 320 or 336.
        stock_and_plugin = {"0.26.0": (640, 656), "0.27.1": (640, 656), "0.28.0": (0, 336)}[adapter.version]
        assert (out["configs"]["stock"]["reused_tokens"], plugin["reused_tokens"]) == stock_and_plugin
        assert "ratio_plugin+tail-both_vs_stock" not in out
        return
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
        "hybrid-kv: --configs 'stock,plugin+tail-all': allowed: stock, stock+retain-0, stock+retain-unit, "
        "stock+retain-4units, stock+retain-block, stock+retain-2blocks, stock+retain-4blocks, stock+shared-prefix, "
        "plugin, plugin+junction, plugin+tail-replay, plugin+tail-both, plugin+output-checkpoint, plugin+hybrid-tier, plugin+divergence, plugin+divergence+hybrid-tier, "
        "plugin+divergence+output-checkpoint+hybrid-tier, plugin+skip-ends, plugin+divergence+skip-ends, "
        "plugin+divergence+hybrid-tier+skip-ends, plugin+store-ends\n"
    )
    assert console_main(["bench", "--requests", "0", "--repeats", "1", "--configs", "stock,stock"]) == 2
    assert capsys.readouterr().err == "hybrid-kv: --configs 'stock,stock': each configuration at most once\n"


def test_bench_counts_bytecodes_per_step_deterministically(adapter):
    """``bytecodes=True``: one more, untimed run per configuration; the count is the same every run."""
    from hybrid_kv_plugin.sim.bench import count_bytecodes

    ticks = itertools.count()
    case = BenchCase("small", tuple(small_workload()))
    out = run_case(case, ReplaySettings(), repeats=1, clock=lambda: float(next(ticks)), bytecodes=True)
    stock = out["configs"]["stock"]
    counted = count_bytecodes(case, ReplaySettings(), CONFIGS["stock"])
    assert counted is not None and counted == count_bytecodes(case, ReplaySettings(), CONFIGS["stock"])
    total, steps = counted
    assert steps == stock["steps"] == STEPS[adapter.version][0]
    assert stock["bytecodes_per_step"] == round(total / steps, 1)
    # The counter counts only inside the two scheduler calls: thousands per step, not the whole run.
    assert 1_000 < stock["bytecodes_per_step"] < 50_000
    # The timed repeats are untouched: still exactly two ticks per step.
    assert stock["step_floor_us"] == 2e6
    if not adapter.supports(Feature.FINE_GRAINED_CPU_HITS):
        assert set(out["configs"]["plugin"]) == {"refused"} and "bytecode_ratio_plugin_vs_stock" not in out
        return
    plugin = out["configs"]["plugin"]
    assert out["bytecode_ratio_plugin_vs_stock"] == round(plugin["bytecodes_per_step"] / stock["bytecodes_per_step"], 4)


# Plugin / stock bytecode instructions per scheduler step on the default workload (plugin's default
# options), measured when this test was written plus about one point of headroom: a change that adds
# per-step work beyond it fails here, deterministically, where CPU timings on a shared machine cannot.
# Measured: 0.26.0 1.0756, 0.27.1 1.0609, 0.28.0 1.0868, 0.29.0 1.0542 (the backport; 1.088 before
# this release's store-path changes), 0.30.0 1.0309, 0.31.0 1.0167, 0.32.0 1.0169, 0.33.0 1.0187;
# at stop 58: 0.26.0 1.0804, 0.27.1 1.0617, 0.28.0 1.0882, 0.29.0 1.0553, 0.30.0 1.0317, 0.31.0 1.0148,
# 0.32.0 1.0153, 0.33.0 1.0153; with the backport's per-block work in C (stop 62): 0.26.0 1.0593,
# 0.27.1 1.0399, 0.28.0 1.0671, 0.29.0 1.0349 (0.30-0.33 within 0.001 of before).
STEP_WORK_BUDGET = {
    "0.26.0": 1.07,
    "0.27.1": 1.05,
    "0.28.0": 1.08,
    "0.29.0": 1.045,
    "0.30.0": 1.04,
    "0.31.0": 1.03,
    "0.32.0": 1.03,
    "0.33.0": 1.03,
}


@functools.cache
def _default_workload_count(config: str, async_scheduling: bool = False) -> tuple[int, int] | None:
    """(bytecodes, steps) of the default workload's scheduler steps under ``config`` (None: refused);
    counted once per process (one wheel), stock's shared by the budget tests."""
    from hybrid_kv_plugin.sim.bench import count_bytecodes
    from hybrid_kv_plugin.sim.workload import default_workload

    settings = ReplaySettings(async_scheduling=async_scheduling)
    return count_bytecodes(BenchCase("default", tuple(default_workload(0))), settings, CONFIGS[config])


def _per_step_ratio(counted: tuple[int, int], stock: tuple[int, int]) -> float:
    return (counted[0] / counted[1]) / (stock[0] / stock[1])


# The same under vLLM's AsyncScheduler (`hybrid-kv bench --async-scheduling`, a GPU `vllm serve`'s
# default), measured 2026-12-06: 0.26.0 1.0997, 0.27.1 1.0802, 0.28.0 1.0964, 0.29.0 1.0597, 0.30.0
# 1.0492, 0.31.0 1.0303, 0.32.0 1.0293, 0.33.0 1.0285 (stock's steps: 135 on 0.26-0.27, 139 on
# 0.28-0.29, 132 on 0.30-0.33, against 98 / 105 / 95 under Scheduler). With remaining_blocks_once_per_step (same
# day): 0.26.0 1.0991, 0.27.1 1.0796, 0.28.0 1.0954, 0.29.0 1.0581, 0.30.0 1.0470, 0.31.0 1.0284, 0.32.0 1.0274,
# 0.33.0 1.0266; under Scheduler 0.26.0 1.0832, 0.28.0 1.0897, 0.29.0 1.0565, 0.33.0 1.0159. With the
# backport's per-block work in C (stop 62): 0.26.0 1.0763, 0.27.1 1.0575, 0.28.0 1.0741, 0.29.0 1.0376.
ASYNC_STEP_WORK_BUDGET = {
    "0.26.0": 1.09,
    "0.27.1": 1.07,
    "0.28.0": 1.085,
    "0.29.0": 1.05,
    "0.30.0": 1.06,
    "0.31.0": 1.04,
    "0.32.0": 1.04,
    "0.33.0": 1.04,
}
# Stock's steps on the default workload per scheduler (the bench reports them).
STOCK_STEPS = {
    False: {"0.26.0": 98, "0.27.1": 98, "0.28.0": 105, "0.29.0": 105},
    True: {"0.26.0": 135, "0.27.1": 135, "0.28.0": 139, "0.29.0": 139},
}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_plugin_step_work_stays_within_its_budget(adapter, async_scheduling):
    """The default workload: the plugin's scheduler step executes at most STEP_WORK_BUDGET x stock's bytecodes
    (ASYNC_STEP_WORK_BUDGET under AsyncScheduler)."""
    stock = _default_workload_count("stock", async_scheduling)
    plugin = _default_workload_count("plugin", async_scheduling)
    assert stock is not None and plugin is not None
    assert stock[1] == STOCK_STEPS[async_scheduling].get(adapter.version, 132 if async_scheduling else 95)
    if adapter.version == "0.29.0":
        assert plugin[1] == (144 if async_scheduling else 107)  # the steps the bench reports
    budget = (ASYNC_STEP_WORK_BUDGET if async_scheduling else STEP_WORK_BUDGET)[adapter.version]
    ratio = _per_step_ratio(plugin, stock)
    assert 1.0 < ratio <= budget, f"plugin / stock bytecodes per step {ratio:.4f}"


# The same with ``mamba_divergence_checkpoint`` on (``plugin+divergence``; 0.29+), where issue #31 sets
# the goals: <= 1.10 on 0.29, <= 1.05 on 0.33. Measured (stop 58): 0.29.0 1.0934, 0.30.0 1.0526,
# 0.31.0 1.0343, 0.32.0 1.0297, 0.33.0 1.0295; budgets about one point above, never past a goal.
# Stop 62 (the backport's per-block work in C): 0.29.0 1.0715.
DIVERGENCE_STEP_WORK_BUDGET = {
    "0.29.0": 1.085,
    "0.30.0": 1.065,
    "0.31.0": 1.045,
    "0.32.0": 1.04,
    "0.33.0": 1.04,
}


# Under AsyncScheduler, measured 2026-12-06: 0.29.0 1.0986, 0.30.0 1.0609, 0.31.0 1.0408, 0.32.0 1.0373,
# 0.33.0 1.0365 (the goals hold there too: <= 1.10 on 0.29, <= 1.05 on 0.33). Stop 62: 0.29.0 1.0746.
ASYNC_DIVERGENCE_STEP_WORK_BUDGET = {
    "0.29.0": 1.085,
    "0.30.0": 1.07,
    "0.31.0": 1.05,
    "0.32.0": 1.045,
    "0.33.0": 1.045,
}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_divergence_step_work_stays_within_its_budget(adapter, async_scheduling):
    """The default workload with divergence checkpoints: at most DIVERGENCE_STEP_WORK_BUDGET x stock's bytecodes a step
    (ASYNC_DIVERGENCE_STEP_WORK_BUDGET under AsyncScheduler)."""
    stock = _default_workload_count("stock", async_scheduling)
    divergence = _default_workload_count("plugin+divergence", async_scheduling)
    assert stock is not None
    budgets = ASYNC_DIVERGENCE_STEP_WORK_BUDGET if async_scheduling else DIVERGENCE_STEP_WORK_BUDGET
    if adapter.version not in budgets:  # 0.26-0.28 refuse the option at start-up
        assert divergence is None
        return
    assert divergence is not None
    ratio = _per_step_ratio(divergence, stock)
    assert 1.0 < ratio <= budgets[adapter.version], f"plugin+divergence / stock bytecodes per step {ratio:.4f}"


def test_the_floor_is_each_steps_minimum_over_the_repeats():
    from hybrid_kv_plugin.sim.bench import _floor

    # Step 0 costs 3 at best, step 1 costs 5 at best: a slow repeat never moves the floor.
    assert _floor([[3.0, 9.0], [7.0, 5.0], [4.0, 6.0]]) == 4.0
    assert _floor([[2.0, 2.0]]) == 2.0
