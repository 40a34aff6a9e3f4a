"""Plugin options: validated at start-up, errors name the key and the allowed values."""

from __future__ import annotations

import pytest

from hybrid_kv_plugin import CONNECTOR_NAME
from hybrid_kv_plugin.config import (
    ConnectorOptions,
    PluginConfigError,
    connector_options_from,
    plugin_config_from,
    plugin_disabled,
)


def test_defaults_are_off():
    assert plugin_config_from(None, environ={}).mamba_shared_prefix_checkpoint is False
    assert plugin_config_from({"other_plugin": {"x": 1}}, environ={}).mamba_shared_prefix_checkpoint is False


def test_switch_from_additional_config_and_env_override():
    on = {"hybrid_kv": {"mamba_shared_prefix_checkpoint": True}}
    assert plugin_config_from(on, environ={}).mamba_shared_prefix_checkpoint is True
    env_on = {"HYBRID_KV_MAMBA_SHARED_PREFIX_CHECKPOINT": "1"}
    assert plugin_config_from(None, environ=env_on).mamba_shared_prefix_checkpoint is True
    env_off = {"HYBRID_KV_MAMBA_SHARED_PREFIX_CHECKPOINT": "off"}
    assert plugin_config_from(on, environ=env_off).mamba_shared_prefix_checkpoint is False


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            {"mamba_shared_prefix_chekpoint": True},
            "hybrid_kv.mamba_shared_prefix_chekpoint: unknown key (allowed keys: async_load_liveness, mamba_divergence_checkpoint, mamba_output_checkpoint, mamba_shared_prefix_checkpoint, prompt_tail_checkpoint)",
        ),
        (
            {"mamba_shared_prefix_checkpoint": "yes"},
            "hybrid_kv.mamba_shared_prefix_checkpoint: Input should be a valid boolean (got 'yes'; allowed: true or false)",
        ),
        (["mamba_shared_prefix_checkpoint"], "hybrid_kv must be a JSON object, got list"),
    ],
)
def test_invalid_plugin_config_names_key(section, message):
    with pytest.raises(PluginConfigError) as err:
        plugin_config_from({"hybrid_kv": section}, environ={})
    assert message in str(err.value)


def test_invalid_env_value_names_variable():
    with pytest.raises(PluginConfigError, match=r"HYBRID_KV_MAMBA_SHARED_PREFIX_CHECKPOINT='maybe' \(allowed: 1, 0"):
        plugin_config_from(None, environ={"HYBRID_KV_MAMBA_SHARED_PREFIX_CHECKPOINT": "maybe"})


@pytest.mark.parametrize(("value", "disabled"), [("1", True), ("true", True), ("0", False), ("", False), ("bogus", True)])
def test_disable_switch_values(value, disabled):
    assert plugin_disabled({"HYBRID_KV_PLUGIN_DISABLE": value}) is disabled
    assert plugin_disabled({}) is False


def test_connector_options_pass_stock_keys_and_reject_typos(adapter):
    stock = adapter.simplecpu_stock_keys
    assert connector_options_from({"cpu_bytes_to_use": 1 << 30, "lazy_offload": False}, stock) == ConnectorOptions()
    with pytest.raises(PluginConfigError) as err:
        connector_options_from({"cpu_bytes_to_us": 1 << 30}, stock)
    assert "kv_connector_extra_config.cpu_bytes_to_us: unknown key (allowed keys: cpu_tier_eviction, cpu_tier_request_ends, fine_grained_hits)" in str(err.value)
    assert "cpu_bytes_to_use, cpu_bytes_to_use_per_rank" in str(err.value)


def test_scheduler_start_up_fails_on_invalid_section(plugin, make_engine):
    with pytest.raises(PluginConfigError, match=r"hybrid_kv\.junction: unknown key"):
        make_engine(additional_config={"hybrid_kv": {"junction": True}})


def test_connector_start_up_fails_on_unknown_option(plugin, make_engine):
    with pytest.raises(PluginConfigError, match=r"kv_connector_extra_config\.cpu_gb: unknown key"):
        make_engine(kv_connector=CONNECTOR_NAME, kv_connector_extra_config={"cpu_gb": 4})


def test_switch_reaches_native_field_where_the_wheel_has_one(plugin, make_engine, adapter, plugin_log):
    from hybrid_kv_plugin.sim.geometry import HybridGeometry

    engine = make_engine(HybridGeometry(eagle=True), additional_config={"hybrid_kv": {"mamba_shared_prefix_checkpoint": True}})
    assert engine.scheduler.hybrid_kv_config.mamba_shared_prefix_checkpoint is True
    flag = adapter.native_junction_flag
    expected_flag = {"0.30.0": "enable_mamba_fine_grained_prefix_cache"}.get(
        adapter.version, "enable_mamba_shared_prefix_checkpoint" if adapter.version >= "0.31" else None
    )
    assert flag == expected_flag
    if flag is not None:
        assert getattr(engine.vllm_config.cache_config, flag) is True
