"""``hybrid-kv replay`` on the installed wheel: exact reuse, steps and loss attribution.

The small workload (``helpers.small_workload``): two conversations whose later
turns follow a GPU-cache eviction (CPU-tier reuse) or not (GPU reuse), and one EAGLE
agent family (root, two siblings on the GPU, two after an eviction). No prompt ends on a
hash boundary, where wheels legitimately place the prompt-tail checkpoint differently.

The plugin's numbers are the same on every wheel that has the feature (0.29 backport,
0.30+ native), and equal to what stock 0.33 measures; stock 0.29 loses the CPU tier's
off-grid reuse, and the attribution names the dropped boundary hand-offs.
"""

from __future__ import annotations

import dataclasses
import io
import json

import pytest

from hybrid_kv_plugin.adapters import Feature
from hybrid_kv_plugin.sim.attribution import Bucket
from hybrid_kv_plugin.sim.configs import CONFIGS
from hybrid_kv_plugin.sim.replay import ReplaySettings, replay
from hybrid_kv_plugin.sim.workload import default_workload

from helpers import KEEPS_EVERY_BLOCK, STEPS, V033_STOCK, small_workload

# V033_STOCK, KEEPS_EVERY_BLOCK and STEPS are in helpers (test_bench reads them too).
V033_JUNCTION = {
    "ideal_tokens": 1856,
    "reused_gpu_tokens": 512,
    "reused_cpu_tokens": 1024,
    "loss": {"no_mamba_state": 256, "eagle_prune": 64},
}
# Per request (reused, from CPU) on the reference: c0-t1 / c1-t1 are served by the CPU tier at
# the previous turn's prompt-tail checkpoint (288 and 192, off the 64-token Mamba grid).
V033_STOCK_REQUESTS = {
    "c0-t0": (0, 0), "c1-t0": (0, 0), "c0-t1": (288, 288), "c1-t1": (192, 192), "c0-t2": (336, 16),
    "root": (0, 0), "s0": (0, 0), "s1": (0, 0), "s2": (0, 0), "s3": (0, 0),
}
V033_JUNCTION_SIBLINGS = {"s0": (0, 0), "s1": (240, 48), "s2": (240, 240), "s3": (240, 240)}

# Stock SimpleCPU without the feature: (reused from GPU, from CPU, loss buckets).
STOCK_WITHOUT_FEATURE = {
    # 0.26-0.27 retain a Mamba state at every whole 64-token block and their SimpleCPU offloads
    # those positionally, so on-grid reuse survives; 0.28 stops offloading them.
    "0.26.0": (816, 832, {"no_mamba_state": 48, "eagle_prune": 64, "handoff_dropped": 96}),
    "0.27.1": (720, 832, {"no_mamba_state": 240, "eagle_prune": 64}),
    "0.28.0": (336, 192, {"no_mamba_state": 240, "eagle_prune": 64, "handoff_dropped": 1024}),
    # 0.29 publishes the boundary hand-offs and its SimpleCPU ignores them.
    "0.29.0": (336, 192, {"no_mamba_state": 976, "eagle_prune": 64, "handoff_dropped": 288}),
}


def summary(result) -> dict:
    s = result.summary()
    return {
        "ideal_tokens": s["ideal_tokens"],
        "reused_gpu_tokens": s["reused_gpu_tokens"],
        "reused_cpu_tokens": s["reused_cpu_tokens"],
        "loss": {k: v for k, v in s["loss"].items() if v},
    }


def assert_buckets_sum_to_the_loss(result) -> None:
    assert sum(result.loss.values()) == result.lost_tokens == result.ideal_tokens - result.reused_tokens
    for segment in result.segments:
        for rid, row in segment.per_request.items():
            assert sum(row["loss"].values()) == max(row["ideal"] - row["reused"], 0), rid


@pytest.fixture(scope="module")
def small_results():
    # The offload invariants watch every run (an AssertionError names any violation).
    return {name: replay(small_workload(), ReplaySettings(), CONFIGS[name], check_invariants=True) for name in CONFIGS}


# The plugin config's (checked loads, checked CPU copies) per segment (chat, agents): every block
# the CPU tier loaded and every copy it published passed the offload invariants. 0.26-0.27 keep a
# Mamba state at every whole block, so their agents segment loads from the CPU tier too.
KEEPS = (("chat", 32, 44), ("agents", 26, 36))
LATER = (("chat", 32, 43), ("agents", 0, 35))
CHECKED = {"0.26.0": KEEPS, "0.27.1": KEEPS, **{v: LATER for v in ("0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")}}


def test_replay_runs_the_offload_invariants(adapter, small_results):
    plugin = small_results["plugin"]
    assert tuple((s.name, s.checked_loads, s.checked_copies) for s in plugin.segments) == CHECKED[adapter.version]


def test_plugin_matches_native_033_wherever_the_feature_exists(adapter, small_results):
    plugin, junction = small_results["plugin"], small_results["plugin+junction"]
    if not adapter.supports(Feature.FINE_GRAINED_CPU_HITS):
        for result in (plugin, junction):
            assert result.refused.startswith(
                f"hybrid-kv-plugin: HybridSimpleCPUConnector cannot serve fine-grained hybrid prefix hits on "
                f"vLLM {adapter.version}"
            )
        return
    if adapter.version in KEEPS_EVERY_BLOCK:
        plugin_summary, junction_summary, unserved, _ = KEEPS_EVERY_BLOCK[adapter.version]
        assert (summary(plugin), summary(junction)) == (plugin_summary, junction_summary)
        assert (small_results["stock"].steps, plugin.steps, junction.steps) == STEPS[adapter.version]
        for result in (plugin, junction):
            assert_buckets_sum_to_the_loss(result)
        assert (plugin.reachable_tokens - plugin.reused_tokens, junction.reachable_tokens - junction.reused_tokens) == (unserved, 0)
        return
    assert summary(plugin) == V033_STOCK
    assert summary(junction) == V033_JUNCTION
    assert {r: (v["reused"], v["cpu"]) for s in plugin.segments for r, v in s.per_request.items()} == V033_STOCK_REQUESTS
    agents = junction.segments[1].per_request
    assert {r: (agents[r]["reused"], agents[r]["cpu"]) for r in V033_JUNCTION_SIBLINGS} == V033_JUNCTION_SIBLINGS
    assert (small_results["stock"].steps, plugin.steps, junction.steps) == STEPS[adapter.version]
    for result in (plugin, junction):
        assert_buckets_sum_to_the_loss(result)
        # Everything a cache could have served was served.
        assert result.reachable_tokens == result.reused_tokens


def test_stock_loses_off_grid_cpu_reuse_and_the_attribution_says_why(adapter, small_results):
    stock = small_results["stock"]
    assert_buckets_sum_to_the_loss(stock)
    if adapter.has_native_fine_grained_cpu_hits:
        assert summary(stock) == V033_STOCK
        return
    gpu, cpu, loss = STOCK_WITHOUT_FEATURE[adapter.version]
    assert (stock.reused_gpu_tokens, stock.reused_cpu_tokens, {k: v for k, v in stock.loss.items() if v}) == (gpu, cpu, loss)
    if adapter.has_boundary_handoffs:
        chat = stock.segments[0].per_request
        # The first continuation (ideal 304): 288 tokens sat at an off-grid prompt-tail state whose
        # hand-off the stock connector ignored; no state was ever kept past the prompt (the answer).
        assert (chat["c0-t1"]["ideal"], chat["c0-t1"]["reused"]) == (304, 0)
        assert chat["c0-t1"]["loss"] == {Bucket.NO_MAMBA_STATE.value: 16, Bucket.HANDOFF_DROPPED.value: 288}


# The chat segment under ``cpu_tier_request_ends: skip``, c0-t2 after a GPU reset too, per request
# (reused, from CPU, loss). c0's prompt ends (288, then 336: off the 64-token grid) never reached the
# CPU tier, and the loss split says so. c0-t1's end was declined in the step where c1-t1's (192, on
# the grid) was kept: the split follows each hand-off, not the step. 0.26-0.27 still have the states
# at the last whole block (256, 320).
SKIPPED_ENDS = {"c0-t1": (0, 0, {"no_mamba_state": 16, "handoff_dropped": 288}), "c1-t1": (192, 192, {}),
                "c0-t2": (0, 0, {"handoff_dropped": 336})}
SKIPPED_ENDS_KEEPS_EVERY_BLOCK = {"c0-t1": (256, 256, {"no_mamba_state": 16, "handoff_dropped": 32}),
                                  "c1-t1": (192, 192, {}), "c0-t2": (320, 320, {"handoff_dropped": 16})}


def test_skipped_request_ends_show_as_dropped_hand_offs(adapter):
    chat = small_workload()[0]
    requests = (*chat.requests[:-1], dataclasses.replace(chat.requests[-1], evict_gpu_before=True))
    result = replay([dataclasses.replace(chat, requests=requests)], ReplaySettings(), CONFIGS["plugin+skip-ends"])
    assert_buckets_sum_to_the_loss(result)
    rows = result.segments[0].per_request
    observed = {r: (rows[r]["reused"], rows[r]["cpu"], {k: v for k, v in rows[r]["loss"].items() if v}) for r in SKIPPED_ENDS}
    assert observed == (SKIPPED_ENDS_KEEPS_EVERY_BLOCK if adapter.version in KEEPS_EVERY_BLOCK else SKIPPED_ENDS)


def test_replay_is_deterministic(small_results):
    again = replay(small_workload(), ReplaySettings(), CONFIGS["stock"])
    assert again.as_dict(per_request=True) == small_results["stock"].as_dict(per_request=True)


# Under CPU pressure (8 CPU blocks, transfers completing 2 steps late), the chat segment only.
# (reused from GPU, from CPU, loss buckets, CPU evictions, dropped_cpu_full or None without counters)
STOCK_PRESSURE = (336, 0, {"no_mamba_state": 16, "evicted": 480}, 21, 1)
PRESSURE = {
    "0.26.0": (336, 0, {"no_mamba_state": 48, "evicted": 448}, 21, None),
    "0.27.1": (336, 0, {"no_mamba_state": 48, "evicted": 448}, 21, None),
    "0.28.0": (336, 0, {"no_mamba_state": 48, "evicted": 448}, 21, None),
    "0.29.0": (336, 0, {"no_mamba_state": 16, "evicted": 480}, 21, None),
    "0.30.0": STOCK_PRESSURE,
    "0.31.0": STOCK_PRESSURE,
    "0.32.0": STOCK_PRESSURE,
    "0.33.0": STOCK_PRESSURE,
}


def test_cpu_pressure_shows_as_evictions_and_cpu_full_drops(adapter):
    settings = ReplaySettings(cpu_blocks=8, transfer_delay_steps=2)
    result = replay(small_workload()[:1], settings, CONFIGS["stock"])
    assert_buckets_sum_to_the_loss(result)
    stats = result.boundary_stats
    observed = (
        result.reused_gpu_tokens,
        result.reused_cpu_tokens,
        {k: v for k, v in result.loss.items() if v},
        result.segments[0].cpu_evictions,
        None if stats is None else stats["dropped_cpu_full"],
    )
    assert observed == PRESSURE[adapter.version]


# The embedded default workload: (efficiency of plugin, of plugin+junction) on wheels with the feature.
# 0.32 moved the prompt-tail checkpoint of a prompt ending exactly on a hash boundary one unit
# down (so an exact replay hits): one default-workload continuation (conv3-t3) then reuses 16
# tokens less. The 0.29 backport follows 0.30, the feature's reference.
DEFAULT_EFFICIENCY = {
    "0.26.0": (0.9305, 0.9468),
    "0.27.1": (0.9305, 0.9489),
    "0.28.0": (0.7505, 0.8425),
    "0.29.0": (0.7505, 0.8425),
    "0.30.0": (0.7505, 0.8425),
    "0.31.0": (0.7505, 0.8425),
    "0.32.0": (0.7485, 0.8405),
    "0.33.0": (0.7485, 0.8405),
}


def test_default_workload_plugin_serves_everything_reachable(adapter):
    if not adapter.supports(Feature.FINE_GRAINED_CPU_HITS):
        result = replay(default_workload(), ReplaySettings(), CONFIGS["plugin"])
        assert result.refused is not None
        return
    plugin = replay(default_workload(), ReplaySettings(), CONFIGS["plugin"])
    junction = replay(default_workload(), ReplaySettings(), CONFIGS["plugin+junction"])
    unserved = KEEPS_EVERY_BLOCK[adapter.version][3] if adapter.version in KEEPS_EVERY_BLOCK else (0, 0)
    for result, left in zip((plugin, junction), unserved):
        assert_buckets_sum_to_the_loss(result)
        assert result.reachable_tokens - result.reused_tokens == left
        lost = {k for k, v in result.loss.items() if v}
        dropped = {Bucket.HANDOFF_DROPPED.value} if left else set()
        assert lost == {Bucket.NO_MAMBA_STATE.value, Bucket.EAGLE_PRUNE.value} | dropped
    assert (round(plugin.efficiency, 4), round(junction.efficiency, 4)) == DEFAULT_EFFICIENCY[adapter.version]


# ---------------------------------------------------------------------------- the command
TRACE = [
    {"id": "a", "prefix_id": "sys", "prefix_len": 200, "suffix_len": 37, "max_tokens": 2},
    {"id": "b", "continues": "a", "suffix_len": 21, "evict_gpu_before": True},
    {"id": "c", "prefix_id": "sys", "prefix_len": 200, "suffix_len": 45},
]


def test_replay_command_json_and_table(adapter, tmp_path, capsys):
    from hybrid_kv_plugin.cli.main import main

    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(item) for item in TRACE) + "\n")
    assert main(["replay", "--trace", str(trace), "--configs", "stock", "--json", "--per-request"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["vllm"] == adapter.version
    assert report["segments"] == [{"name": "main", "requests": 3, "eagle": False}]
    (stock,) = report["results"]
    rows = stock["segments"][0]["per_request"]
    assert [rows[r]["ideal"] for r in ("a", "b", "c")] == [0, 224, 192]
    assert stock["ideal_tokens"] == 416
    assert sum(stock["loss"].values()) == stock["lost_tokens"]
    assert main(["replay", "--trace", str(trace), "--configs", "stock"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"hybrid-kv replay on vLLM {adapter.version}: 3 requests (main 3)\n")
    assert "geometry: FA 16 / Mamba 64 align / prefix-match unit 16; GPU 1024 blocks, CPU 8192 blocks" in text
    assert "  no Mamba state on the grid" in text and "  total lost" in text


def test_replay_command_rejects_bad_input(tmp_path, capsys):
    from hybrid_kv_plugin.cli.main import console_main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "tokens": []}\n')
    assert console_main(["replay", "--trace", str(bad)]) == 2
    assert capsys.readouterr().err == f"hybrid-kv: --trace {bad}: trace line 1: empty prompt\n"
    assert console_main(["replay", "--configs", "stock,fast"]) == 2
    assert capsys.readouterr().err == (
        "hybrid-kv: --configs 'stock,fast': allowed: stock, stock+retain-0, stock+retain-unit, stock+retain-4units, "
        "stock+retain-block, stock+retain-2blocks, stock+retain-4blocks, stock+shared-prefix, plugin, plugin+junction, "
        "plugin+tail-replay, plugin+tail-both, plugin+output-checkpoint, plugin+hybrid-tier, plugin+divergence, plugin+divergence+hybrid-tier, "
        "plugin+divergence+output-checkpoint+hybrid-tier, plugin+skip-ends, plugin+divergence+skip-ends, "
        "plugin+divergence+hybrid-tier+skip-ends, plugin+store-ends\n"
    )


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch, tmp_path, capsys):
    import sys

    from hybrid_kv_plugin.cli.main import console_main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an environment without it looks like
    assert console_main(["replay", "--plot", str(tmp_path / "reuse.png")]) == 2
    assert capsys.readouterr().err == (
        "hybrid-kv: --plot needs matplotlib, which is not installed here; "
        "install the optional extra: pip install 'hybrid-kv-plugin[plot]'\n"
    )


def _report(version: str, efficiency: float, refused: bool = False) -> dict:
    ran = {
        "name": "plugin", "ideal_tokens": 100, "reused_gpu_tokens": 10, "reused_cpu_tokens": 80,
        "efficiency": efficiency, "efficiency_of_reachable": 1.0, "steps": 7,
        "loss": {b.value: (10 if b is Bucket.NO_MAMBA_STATE else 0) for b in Bucket},
    }
    second = {"name": "stock", "refused": "no"} if refused else dict(ran, name="stock")
    return {"vllm": version, "results": [second, ran]}


def test_compare_renders_saved_reports_side_by_side(tmp_path):
    from hybrid_kv_plugin.cli.compare import render_comparison

    paths = []
    for version, refused in (("0.28.0", True), ("0.33.0", False)):
        path = tmp_path / f"{version}.json"
        path.write_text(json.dumps(_report(version, 0.9, refused)))
        paths.append(str(path))
    out = io.StringIO()
    assert render_comparison(paths, out) == 0
    assert out.getvalue().splitlines() == [
        "                                  | vLLM 0.28.0           | vLLM 0.33.0",
        "                                  |      stock     plugin |      stock     plugin",
        "ideal tokens                      |    refused        100 |        100        100",
        "reused from GPU                   |    refused         10 |         10         10",
        "reused from CPU                   |    refused         80 |         80         80",
        "efficiency                        |    refused      0.900 |      0.900      0.900",
        "reused / reachable                |    refused      1.000 |      1.000      1.000",
        "scheduler steps                   |    refused          7 |          7          7",
        "lost: no Mamba state on the grid  |    refused         10 |         10         10",
    ]


def test_progress_bar_draws_only_on_a_terminal():
    from hybrid_kv_plugin.cli.progress import Progress

    now = iter([0.0, 10.0, 30.0])
    stream = io.StringIO()
    bar = Progress(20, stream=stream, enabled=True, clock=lambda: next(now))
    bar.start("stock")
    bar.update(5)
    bar.finish_run(10)
    bar.start("plugin")
    bar.update(5)
    assert stream.getvalue().split("\r")[1:] == [
        "stock            [#######.......................] 5/20 requests, 10s elapsed, ETA 30s",
        "plugin           [######################........] 15/20 requests, 30s elapsed, ETA 10s",
    ]
    quiet = io.StringIO()
    Progress(20, stream=quiet).update(5)  # StringIO is not a terminal
    assert quiet.getvalue() == ""


def test_progress_lines_every_tenth_when_not_a_terminal():
    from hybrid_kv_plugin.cli.progress import Progress

    now = iter([0.0, 2.0, 4.0, 20.0, 20.0])
    log = io.StringIO()
    progress = Progress(40, stream=log, lines=True, clock=lambda: next(now))
    progress.start("stock")
    progress.update(3)  # under 10 % and under a minute: nothing yet
    progress.update(10)  # crosses 10 % and 20 %: one line
    progress.start("plugin [2/2]", 1)  # a run of its own: "1/1" for a one-request run
    progress.update(1)
    assert log.getvalue().splitlines() == [
        "stock: 10/40 requests (20%), 4s elapsed, ETA 12s",
        "plugin [2/2]: 1/1 requests (100%), 0s elapsed, ETA 0s",
    ]


def test_progress_line_at_least_every_minute_between_tenths(mocker):
    """A full trace spends minutes per 10 %: a quiet minute gets a line with the exact share and ETA."""
    from hybrid_kv_plugin.cli.progress import Progress

    clock = mocker.Mock(side_effect=[100.0, 100.0, 130.0, 161.0, 190.0, 222.0, 290.0])
    log = io.StringIO()
    progress = Progress(12_031, stream=log, lines=True, clock=clock)
    progress.start("stock [1/2]", 12_031)
    progress.update(100)  # 30 s: quiet
    progress.update(250)  # 61 s since the start: a line
    progress.update(400)  # 29 s since that line: quiet
    progress.update(1_204)  # crosses 10 %: a line
    progress.update(1_300)  # 68 s after it: a line
    assert log.getvalue().splitlines() == [
        "stock [1/2]: 250/12031 requests (2%), 61s elapsed, ETA 2875s",
        "stock [1/2]: 1204/12031 requests (10%), 122s elapsed, ETA 1097s",
        "stock [1/2]: 1300/12031 requests (10%), 190s elapsed, ETA 1568s",
    ]
    assert clock.call_count == 7
