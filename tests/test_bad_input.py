"""Bad input at start-up, through the real Scheduler and connector of the installed wheel.

Every plugin option with a wrong type, an out-of-range value, an unknown key or a
conflicting combination either stops start-up with a message naming the key and
what it accepts, or is a documented no-op that says so in one log line. The
plugin's connector on a non-hybrid model is the stock connector, step for step;
an unsupported wheel or a changed patch target leaves vLLM stock with one line.
"""

from __future__ import annotations

import inspect
import logging

import pytest

import hybrid_kv_plugin
from hybrid_kv_plugin import CONNECTOR_NAME, registration
from hybrid_kv_plugin.adapters import Feature
from hybrid_kv_plugin.adapters.detect import InstalledVllm
from hybrid_kv_plugin.config import PluginConfigError
from hybrid_kv_plugin.offload.mode import OffloadMode
from hybrid_kv_plugin.patching import is_patched
from hybrid_kv_plugin.sim import HybridGeometry
from hybrid_kv_plugin.patches import patch_specs

from helpers import tokens

CPU = {"cpu_bytes_to_use": 1 << 20}
FULL_ATTENTION = HybridGeometry(full_attention_only=True, num_gpu_blocks=64)


def _start(make_engine, **kwargs):
    return make_engine(**kwargs)


# ---------------------------------------------------------------------- additional_config["hybrid_kv"]
@pytest.mark.parametrize(
    ("key", "value"),
    [
        *(("mamba_shared_prefix_checkpoint", v) for v in (1, "yes", None, [True])),
        *(("async_load_liveness", v) for v in (0, "false", None)),
    ],
)
def test_switch_wrong_type(plugin, make_engine, key, value):
    with pytest.raises(PluginConfigError) as err:
        make_engine(additional_config={"hybrid_kv": {key: value}})
    assert f"hybrid_kv.{key}: Input should be a valid boolean" in str(err.value)
    assert f"(got {value!r}; allowed: true or false)" in str(err.value)


def test_switch_unknown_key(plugin, make_engine):
    with pytest.raises(PluginConfigError) as err:
        make_engine(additional_config={"hybrid_kv": {"mamba_shared_prefix_chekpoint": True}})
    assert str(err.value) == (
        "invalid hybrid-kv-plugin configuration: hybrid_kv.mamba_shared_prefix_chekpoint: unknown key "
        "(allowed keys: async_load_liveness, mamba_divergence_checkpoint, mamba_output_checkpoint, mamba_shared_prefix_checkpoint, prompt_tail_checkpoint)"
    )


def test_switch_section_not_an_object(plugin, make_engine):
    with pytest.raises(PluginConfigError) as err:
        make_engine(additional_config={"hybrid_kv": "on"})
    assert str(err.value) == (
        "invalid hybrid-kv-plugin configuration: hybrid_kv must be a JSON object, got str "
        "(allowed keys: async_load_liveness, mamba_divergence_checkpoint, mamba_output_checkpoint, mamba_shared_prefix_checkpoint, prompt_tail_checkpoint)"
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("sometimes", "HYBRID_KV_MAMBA_SHARED_PREFIX_CHECKPOINT='sometimes' (allowed: 1, 0, true, false, yes, no, on, off)"),
        # A valid value on an engine without EAGLE: the conflict names the variable, not the key.
        ("on", "environment variable HYBRID_KV_MAMBA_SHARED_PREFIX_CHECKPOINT='on' needs EAGLE-style speculative decoding"),
    ],
)
def test_switch_env_override_errors_name_the_variable(plugin, make_engine, monkeypatch, value, message):
    monkeypatch.setenv("HYBRID_KV_MAMBA_SHARED_PREFIX_CHECKPOINT", value)
    with pytest.raises(PluginConfigError) as err:
        make_engine()
    assert message in str(err.value)


def test_switch_without_eagle_is_refused(plugin, make_engine):
    """A conflict: the junction checkpoint exists for EAGLE's block drop and could never act."""
    with pytest.raises(PluginConfigError) as err:
        make_engine(additional_config={"hybrid_kv": {"mamba_shared_prefix_checkpoint": True}})
    assert str(err.value) == (
        "invalid hybrid-kv-plugin configuration: hybrid_kv.mamba_shared_prefix_checkpoint: true needs EAGLE-style "
        "speculative decoding (--speculative-config method eagle, eagle3 or mtp) and this engine has no "
        "speculative decoding (allowed without EAGLE: false)"
    )


# ---------------------------------------------------------------------- kv_connector_extra_config
@pytest.mark.parametrize("value", ["no", 0, None])
def test_fine_grained_hits_wrong_type(plugin, make_engine, value):
    with pytest.raises(PluginConfigError) as err:
        make_engine(kv_connector=CONNECTOR_NAME, kv_connector_extra_config={**CPU, "fine_grained_hits": value})
    assert "kv_connector_extra_config.fine_grained_hits: Input should be a valid boolean" in str(err.value)
    assert f"(got {value!r}; allowed: true or false)" in str(err.value)


def test_connector_unknown_key_lists_both_key_sets(plugin, make_engine, adapter):
    with pytest.raises(PluginConfigError) as err:
        make_engine(kv_connector=CONNECTOR_NAME, kv_connector_extra_config={**CPU, "fine_grained": True})
    assert str(err.value) == (
        "invalid hybrid-kv-plugin configuration: kv_connector_extra_config.fine_grained: unknown key "
        f"(allowed keys: cpu_tier_eviction, cpu_tier_request_ends, fine_grained_hits); this vLLM's SimpleCPU keys: {', '.join(sorted(adapter.simplecpu_stock_keys))}"
    )


STOCK_KEY_CASES = [
    ("lazy_offload", "false", "true or false"),  # vLLM's bool("false") would turn lazy offload on
    ("cpu_bytes_to_use", 0, "a positive integer"),  # vLLM would size a one-block CPU pool
    ("cpu_bytes_to_use", -(1 << 20), "a positive integer"),
    ("cpu_bytes_to_use", "4GB", "a positive integer"),
    ("cpu_bytes_to_use_per_rank", 1.5, "a positive integer"),
    ("disk_buffer_slots", 0, "a positive integer"),
    ("use_page_cache", 1, "true or false"),
    ("num_cpu_blocks", -4, "a positive integer or null"),
]


@pytest.mark.parametrize(("key", "value", "allowed"), STOCK_KEY_CASES)
def test_stock_key_misread_by_vllm_is_refused(plugin, make_engine, adapter, key, value, allowed):
    extra = {**CPU, key: value}
    if key not in adapter.simplecpu_stock_keys:
        # This wheel's SimpleCPU does not read the key: it is an unknown key here.
        with pytest.raises(PluginConfigError, match=rf"kv_connector_extra_config\.{key}: unknown key"):
            make_engine(kv_connector=CONNECTOR_NAME, kv_connector_extra_config=extra)
        return
    with pytest.raises(PluginConfigError) as err:
        make_engine(kv_connector=CONNECTOR_NAME, kv_connector_extra_config=extra)
    assert str(err.value) == (
        f"invalid hybrid-kv-plugin configuration: kv_connector_extra_config.{key}: got {value!r} (allowed: {allowed})"
    )


def test_fine_grained_hits_are_accepted_on_every_wheel(plugin, make_engine, adapter):
    """0.26-0.29: the plugin's backport (0.26-0.28 with the hand-off channel it adds); 0.30+: native."""
    engine = make_engine(kv_connector=CONNECTOR_NAME, kv_connector_extra_config=dict(CPU))
    expected = OffloadMode.NATIVE if adapter.has_native_fine_grained_cpu_hits else OffloadMode.BACKPORT
    assert engine.connector.offload_mode is expected
    opted_out = make_engine(kv_connector=CONNECTOR_NAME, kv_connector_extra_config={**CPU, "fine_grained_hits": False})
    assert opted_out.connector.offload_mode is (OffloadMode.NATIVE if adapter.has_native_fine_grained_cpu_hits else OffloadMode.STOCK)


def test_lazy_offload_with_explicit_fine_grained_hits_is_refused(plugin, make_engine):
    extra = {**CPU, "lazy_offload": True, "fine_grained_hits": True}
    with pytest.raises(PluginConfigError) as err:
        make_engine(kv_connector=CONNECTOR_NAME, kv_connector_extra_config=extra)
    assert str(err.value) == (
        "invalid hybrid-kv-plugin configuration: kv_connector_extra_config.fine_grained_hits: true conflicts with "
        "lazy_offload: true (lazy offload stores no Mamba boundary states, so CPU hits stay on whole scheduler "
        "blocks); allowed: fine_grained_hits false or unset with lazy offload, or lazy_offload false"
    )


def test_lazy_offload_with_default_fine_grained_hits(plugin, make_engine, adapter):
    """Unset, not a conflict: lazy stores carry no boundary states, so CPU hits stay on the scheduler block."""
    extra = {**CPU, "lazy_offload": True}
    assert adapter.supports(Feature.FINE_GRAINED_CPU_HITS)  # every supported wheel (0.26-0.29 backported)
    engine = make_engine(kv_connector=CONNECTOR_NAME, kv_connector_extra_config=extra)
    manager = engine.offload_manager
    assert manager._lazy_mode is True
    assert manager.cpu_coordinator.enable_partial_hash_hits is False


# ---------------------------------------------------------------------- non-hybrid model
def _trace(engine):
    """Per step: (scheduled tokens, stored GPU blocks, loaded GPU blocks)."""
    steps = []
    original = engine.connector.build_connector_meta

    def build_connector_meta(scheduler_output):
        meta = original(scheduler_output)
        steps.append((dict(scheduler_output.num_scheduled_tokens), list(meta.store_gpu_blocks), list(meta.load_gpu_blocks)))
        return meta

    engine.connector.build_connector_meta = build_connector_meta
    return steps


def _non_hybrid_workload(engine):
    trace = _trace(engine)
    engine.run([("a", tokens(200)), ("b", tokens(136))], max_tokens=5)
    assert engine.reset_prefix_cache()
    hits = engine.run([("c", tokens(200) + [3, 4, 5]), ("d", tokens(100, offset=300))], max_tokens=3)
    return hits, trace


def test_plugin_connector_on_a_non_hybrid_model_is_the_stock_one(plugin, make_engine, adapter):
    stock = make_engine(FULL_ATTENTION, kv_connector="SimpleCPUOffloadConnector", kv_connector_extra_config=dict(CPU))
    ours = make_engine(FULL_ATTENTION, kv_connector=CONNECTOR_NAME, kv_connector_extra_config=dict(CPU))
    # Without a Mamba group there is nothing fine-grained to do: the stock scheduler runs.
    expected_mode = OffloadMode.NATIVE if adapter.has_native_fine_grained_cpu_hits else OffloadMode.STOCK
    assert ours.connector.offload_mode is expected_mode
    assert type(ours.offload_manager) is type(stock.offload_manager)
    stock_hits, stock_trace = _non_hybrid_workload(stock)
    our_hits, our_trace = _non_hybrid_workload(ours)
    # 200 tokens = 12 full blocks of 16 come back from the CPU tier; "d" shares nothing.
    assert stock_hits == our_hits == {"c": 192, "d": 0}
    assert our_trace == stock_trace
    assert ours.connector.get_boundary_store_stats().published == 0


# ---------------------------------------------------------------------- registration
def _changed(*args, **kwargs):  # a signature no patch target has
    raise AssertionError("never called")


def test_every_changed_patch_target_leaves_vllm_stock(no_plugin, monkeypatch, plugin_log, adapter):
    """Each of this wheel's targets in turn (test_registration covers Scheduler.__init__ once)."""
    specs = patch_specs(adapter)
    resolved = [(spec, *spec.resolve()) for spec in specs]
    for spec, owner, attr, _original in resolved:
        with monkeypatch.context() as patch:
            patch.setattr(owner, attr, _changed)
            plugin_log.records.clear()
            hybrid_kv_plugin.register()
            assert registration.STATE.status == "mismatch", spec.target
            lines = plugin_log.messages(logging.WARNING)
            assert len(lines) == 1
            # The line names the first target, in install order, that sees the change: the
            # changed one, or an earlier patch whose fingerprint covers it (0.29: the junction
            # coordinator checks the MambaManager methods that prompt_tail_manager and, on
            # 0.26-0.28, mamba_boundary_handoffs wrap).
            named = next(
                other.target
                for other in specs[: specs.index(spec) + 1]
                if lines[0].startswith(f"hybrid-kv-plugin: inert, nothing patched: patch target {other.target} changed")
            )
            if named.startswith(f"{spec.target}."):
                # An earlier patch of a method of the changed class (0.26: connector_hit_reconcile
                # before junction_coordinator) no longer finds its method.
                assert f"({named.rsplit('.', 1)[1]} not found)" in lines[0], lines[0]
            elif named != spec.target:
                assert f"{owner.__name__}.{attr} is not (" in lines[0], lines[0]
            assert lines[0].endswith("supported vLLM >=0.26.0,<0.34.0")
            for other, other_owner, other_attr, other_original in resolved:
                # Two patches may wrap one target (0.29: the Mamba split): both see the change.
                if other.target != spec.target:
                    assert inspect.getattr_static(other_owner, other_attr) is other_original, other.target
                    assert not is_patched(inspect.getattr_static(other_owner, other_attr))
            hybrid_kv_plugin.uninstall()
    assert len(resolved) == len(specs)


def test_unidentifiable_build_is_inert_with_one_line(no_plugin, monkeypatch, plugin_log):
    import hybrid_kv_plugin.adapters as adapters

    monkeypatch.setattr(adapters, "installed_vllm", lambda: InstalledVllm("dev", None))
    monkeypatch.setattr(adapters, "probe_family", lambda: None)
    hybrid_kv_plugin.register()
    hybrid_kv_plugin.register()
    assert registration.STATE.status == "unsupported"
    assert plugin_log.messages() == [
        "hybrid-kv-plugin: inert, vLLM 'dev': no known feature set found; vLLM runs stock"
    ]
