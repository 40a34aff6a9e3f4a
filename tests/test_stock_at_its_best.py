"""Stock vLLM at its best in ``replay``: its own knobs for keeping Mamba states (the prefix-cache
retention interval swept over 0, the unit, multiples and the Mamba block; the native
shared-prefix checkpoint where the wheel has one) as ``stock…`` configurations at the same
GPU and CPU budgets, in every default run; and what each configuration pays for the states
it keeps (states held in the GPU prefix cache and on the CPU tier, their bytes, prefill chunks).

The workload: three requests share a 180-token prefix and branch (unit 16, Mamba block 64,
one chunk each). No stock knob keeps a state inside the shared prefix: a state exists where a
chunk ended, and each prompt is one chunk. The plugin's divergence checkpoint keeps one at
176 when the second request finds attention KV past its deepest state, so the third reuses 176.
"""

from __future__ import annotations

import io
import os

from hybrid_kv_plugin.cli.args import DEFAULT_STOCK_CONFIGS, choose_configs
from hybrid_kv_plugin.cli.report import best_stock, build_report, render_report
from hybrid_kv_plugin.registration import current_adapter
from hybrid_kv_plugin.sim.configs import CONFIGS, STOCK_AT_ITS_BEST, Retention
from hybrid_kv_plugin.sim.engine import SimEngine
from hybrid_kv_plugin.sim.geometry import HybridGeometry
from hybrid_kv_plugin.sim.replay import ReplaySettings, replay
from hybrid_kv_plugin.sim.workload import Segment, TraceRequest

SHARED = tuple(range(1000, 1180))
BRANCH = [
    Segment(
        "branch",
        (
            TraceRequest("first", 0, SHARED + tuple(range(5000, 5120)), 1),
            TraceRequest("second", 1, SHARED + tuple(range(6000, 6100)), 1),
            TraceRequest("third", 2, SHARED + tuple(range(7000, 7100)), 1),
        ),
        eagle=False,
    )
]
# One Mamba state of the simulator's model: one page of 16 tokens x 64 bytes.
STATE_BYTES = 1024


def _run(name):
    return replay(BRANCH, ReplaySettings(), CONFIGS[name])


def _reuse(result):
    return {rid: row["reused"] for rid, row in result.segments[0].per_request.items()}


# ---------------------------------------------------------------------------- the configurations
def test_every_stock_configuration_is_stock_vllm_and_the_default_run_compares_them():
    assert [c.name for c in STOCK_AT_ITS_BEST] == [
        "stock+retain-0", "stock+retain-unit", "stock+retain-4units", "stock+retain-block",
        "stock+retain-2blocks", "stock+retain-4blocks", "stock+shared-prefix",
    ]
    assert all(not c.plugin and c.connector == CONFIGS["stock"].connector for c in STOCK_AT_ITS_BEST)
    chosen = [c.name for c in choose_configs(None, BRANCH)]
    assert chosen == [*DEFAULT_STOCK_CONFIGS, "plugin", "plugin+divergence"]
    assert DEFAULT_STOCK_CONFIGS == (
        "stock", "stock+retain-0", "stock+retain-unit", "stock+retain-block", "stock+shared-prefix",
    )


def test_the_retention_interval_resolves_against_the_run_geometry():
    geometry = HybridGeometry(hash_block_size=16, mamba_block_size=64)
    adapter = current_adapter()
    intervals = {
        c.name: c.engine_geometry(geometry, adapter).prefix_cache_retention_interval for c in STOCK_AT_ITS_BEST
    }
    assert intervals == {
        "stock+retain-0": 0, "stock+retain-unit": 16, "stock+retain-4units": 64, "stock+retain-block": 64,
        "stock+retain-2blocks": 128, "stock+retain-4blocks": 256, "stock+shared-prefix": 0,
    }
    assert Retention(units=1).tokens(HybridGeometry(hash_block_size=16, mamba_block_size=544)) == 16
    assert CONFIGS["stock"].engine_geometry(geometry, adapter) == geometry  # dense, the engine default
    switched = CONFIGS["stock+shared-prefix"].engine_geometry(geometry, adapter).extra_cache_config
    assert switched == ({adapter.native_junction_flag: True} if adapter.native_junction_flag else {})


def test_wheels_that_read_the_interval_from_the_environment_get_it_there_while_the_engine_is_built():
    from hybrid_kv_plugin.adapters.vllm_0_28 import Vllm028Adapter
    from hybrid_kv_plugin.adapters.vllm_0_29 import Vllm029Adapter

    name = Vllm028Adapter.retention_interval_env_var
    assert name == "VLLM_PREFIX_CACHE_RETENTION_INTERVAL" and name not in os.environ
    config = CONFIGS["stock+retain-block"]
    geometry = config.engine_geometry(HybridGeometry(), Vllm028Adapter)
    with config.engine_environment(geometry, Vllm028Adapter):
        assert os.environ[name] == "64"
    assert name not in os.environ
    with config.engine_environment(geometry, Vllm029Adapter):  # 0.29+: the KVCacheConfig carries it
        assert name not in os.environ


# ---------------------------------------------------------------------------- the branching workload
# 0.26-0.28 (retention from VLLM_PREFIX_CACHE_RETENTION_INTERVAL; every accepted interval gives the
# same row), measured in this stop's CI and not explained yet: 0.26 reaches the divergence point
# (176) for the second and third request, 0.27 reaches 128 (two Mamba blocks) for the third.
OLD_WHEEL_STOCK = {
    "0.26.0": ({"first": 0, "second": 176, "third": 176}, 0),
    "0.27.1": ({"first": 0, "second": 0, "third": 128}, 96),
    "0.28.0": ({"first": 0, "second": 0, "third": 0}, 96),
}


def test_no_stock_knob_keeps_a_state_inside_the_shared_prefix_the_divergence_checkpoint_does():
    adapter = current_adapter()
    scheduler_block = SimEngine(HybridGeometry(mamba_block_size=64)).scheduler_block_size
    for config in STOCK_AT_ITS_BEST:
        result = _run(config.name)
        interval = config.engine_geometry(HybridGeometry(), adapter).prefix_cache_retention_interval
        if config.native_shared_prefix_checkpoint and adapter.native_junction_flag is None:
            assert result.refused == (
                "this vLLM has no native shared-prefix checkpoint switch (CacheConfig, vLLM PR #53945; 0.30+)"
            )
        elif interval % scheduler_block:
            assert result.refused.startswith("vLLM refuses it: ")
            assert f"({interval}) must be non-negative and a multiple of scheduler_block_size ({scheduler_block})" in (
                result.refused
            )
        else:
            reuse, no_state = OLD_WHEEL_STOCK.get(adapter.version, ({"first": 0, "second": 0, "third": 0}, 352))
            assert result.refused is None, config.name
            assert (result.ideal_tokens, _reuse(result)) == (352, reuse), config.name
            assert result.loss["no_mamba_state"] == no_state
    divergence = _run("plugin+divergence")
    if not adapter.divergence_checkpoint_supported:
        assert divergence.refused.endswith(f"needs vLLM >= 0.29.0 and this is vLLM {adapter.version} (allowed here: false)")
        return
    assert (divergence.ideal_tokens, _reuse(divergence)) == (352, {"first": 0, "second": 0, "third": 176})
    assert divergence.loss["no_mamba_state"] == 176 and divergence.loss["unexplained"] == 0


def _states(gpu, cpu, chunks):
    def tier(peak, mean, mean_bytes):
        return {"peak": peak, "mean": mean, "final": peak, "peak_bytes": peak * STATE_BYTES, "mean_bytes": mean_bytes}
    return {"gpu": tier(*gpu), "cpu": tier(*cpu), "prefill_chunks": chunks,
            "prefill_chunks_per_request": round(chunks / 3, 3), "extra_chunks_per_request": 0.0}


# (stock, stock+retain-0) on 0.26/0.27, measured in this stop's CI (their hand-offs come from the
# plugin's own channel, more chunks: 11 and 10 instead of 8).
OLD_WHEEL_STATES = {
    "0.26.0": (_states((8, 5.8, 5939), (5, 3.5, 3584), 11), _states((6, 4.5, 4608), (3, 2.2, 2253), 11)),
    "0.27.1": (_states((7, 5.2, 5325), (4, 3.0, 3072), 10), _states((7, 5.2, 5325), (4, 3.0, 3072), 10)),
}


def test_each_configuration_reports_the_states_it_keeps_their_bytes_and_its_chunks():
    adapter = current_adapter()
    results = [_run(name) for name in ("stock", "stock+retain-0", "plugin+divergence")]
    if not adapter.divergence_checkpoint_supported:
        assert results[2].refused == (
            "invalid hybrid-kv-plugin configuration: hybrid_kv.mamba_divergence_checkpoint: true needs "
            f"vLLM >= 0.29.0 and this is vLLM {adapter.version} (allowed here: false)"
        )
        results = results[:2]
    report = build_report(BRANCH, ReplaySettings(), results)
    # Stock SimpleCPU stores the Mamba states the GPU cache keeps where the wheel loads them
    # itself (fine-grained hits, vLLM PR #54736); before, only those on its block grid.
    native = current_adapter().has_native_fine_grained_cpu_hits
    assert report["mamba_state_bytes"] == STATE_BYTES
    states = {row["name"]: row["mamba_states"] for row in report["results"]}
    if adapter.version in OLD_WHEEL_STATES:
        assert (states["stock"], states["stock+retain-0"]) == OLD_WHEEL_STATES[adapter.version]
        assert "plugin+divergence" not in states and best_stock(report["results"])["name"] == "stock"
        return
    assert states["stock"] == {
        "gpu": {"peak": 5, "mean": 3.5, "final": 5, "peak_bytes": 5 * STATE_BYTES, "mean_bytes": 3584},
        "cpu": (
            {"peak": 5, "mean": 3.5, "final": 5, "peak_bytes": 5 * STATE_BYTES, "mean_bytes": 3584}
            if native
            else {"peak": 2, "mean": 1.2, "final": 2, "peak_bytes": 2 * STATE_BYTES, "mean_bytes": 1229}
        ),
        "prefill_chunks": 8,
        "prefill_chunks_per_request": 2.667,
        "extra_chunks_per_request": 0.0,
    }
    assert states["stock+retain-0"] == {
        "gpu": {"peak": 3, "mean": 2.2, "final": 3, "peak_bytes": 3 * STATE_BYTES, "mean_bytes": 2253},
        "cpu": (
            {"peak": 3, "mean": 2.2, "final": 3, "peak_bytes": 3 * STATE_BYTES, "mean_bytes": 2253}
            if native
            else {"peak": 0, "mean": 0.0, "final": 0, "peak_bytes": 0, "mean_bytes": 0}
        ),
        "prefill_chunks": 8,
        "prefill_chunks_per_request": 2.667,
        "extra_chunks_per_request": 0.0,
    }
    # One state more in each tier (at 176), and one chunk fewer: the third request starts at 176.
    assert adapter.divergence_checkpoint_supported or "plugin+divergence" not in states
    assert not adapter.divergence_checkpoint_supported or states["plugin+divergence"] == {
        "gpu": {"peak": 6, "mean": 4.2, "final": 6, "peak_bytes": 6 * STATE_BYTES, "mean_bytes": 4301},
        "cpu": {"peak": 6, "mean": 4.2, "final": 6, "peak_bytes": 6 * STATE_BYTES, "mean_bytes": 4301},
        "prefill_chunks": 7,
        "prefill_chunks_per_request": 2.333,
        "extra_chunks_per_request": -0.334,
    }
    assert best_stock(report["results"])["name"] == "stock"
    out = io.StringIO()
    render_report(report, out)
    text = out.getvalue()
    assert "Mamba states kept (cached state blocks, sampled as requests finish; 1.0 KiB a state)" in text
    assert "  (stock at its best in this run: stock, at the same GPU and CPU memory)" in text


def test_a_resolved_model_prices_a_state_as_a_page_per_mamba_layer():
    from hybrid_kv_plugin.cli.report import mamba_state_bytes

    # Qwen3-Next-80B-A3B at unit 16: 36 Mamba layers of 1,114,112-byte pages.
    assert mamba_state_bytes({}, {"mamba_layers": 36, "page_bytes": 1114112}) == 40108032
