"""register()/uninstall() through vLLM's own plugin loader, on the installed stock wheel."""

from __future__ import annotations

import inspect
import json
import logging

import pytest

import hybrid_kv_plugin
from hybrid_kv_plugin import CONNECTOR_NAME, registration
from hybrid_kv_plugin.adapters.detect import InstalledVllm
from hybrid_kv_plugin.patching import PatchSet, is_patched
from hybrid_kv_plugin.patches import patch_specs

from helpers import tokens


def _load_through_vllm(monkeypatch, allowed: str | None = None):
    import vllm.plugins

    if allowed is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", allowed)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()


def _resolved(adapter):
    return [(spec, *spec.resolve()) for spec in patch_specs(adapter)]


def _registry():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return KVConnectorFactory._registry


def test_vllm_loader_discovers_and_registers(no_plugin, monkeypatch, adapter):
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    _load_through_vllm(monkeypatch)

    assert registration.STATE.status == "active"
    assert registration.STATE.calls == 1
    assert len(registration.STATE.patch_set.specs) == len(patch_specs(adapter))
    config = KVTransferConfig(kv_connector=CONNECTOR_NAME, kv_role="kv_both")
    connector_cls = KVConnectorFactory.get_connector_class(config)
    assert connector_cls.__name__ == "HybridSimpleCPUConnector"
    assert connector_cls.__module__ == "hybrid_kv_plugin.connector.simple_cpu"


def test_register_twice_changes_nothing(plugin, adapter):
    before = [inspect.getattr_static(owner, attr) for _, owner, attr, _ in _resolved(adapter)]
    loader_before = _registry()[CONNECTOR_NAME]

    hybrid_kv_plugin.register()

    after = [inspect.getattr_static(owner, attr) for _, owner, attr, _ in _resolved(adapter)]
    assert [a is b for a, b in zip(before, after)] == [True] * len(before)
    assert all(is_patched(obj) for obj in after)
    assert _registry()[CONNECTOR_NAME] is loader_before
    assert registration.STATE.calls == 2
    assert registration.STATE.installs == 1


def test_uninstall_restores_every_original(no_plugin, adapter):
    originals = [(owner, attr, original) for _, owner, attr, original in _resolved(adapter)]
    assert not any(is_patched(o) for *_, o in originals)

    hybrid_kv_plugin.register()
    assert all(is_patched(inspect.getattr_static(owner, attr)) for owner, attr, _ in originals)
    hybrid_kv_plugin.uninstall()

    for owner, attr, original in originals:
        assert inspect.getattr_static(owner, attr) is original, f"{owner}.{attr} not restored"
    assert CONNECTOR_NAME not in _registry()
    assert registration.STATE.status == "unregistered"


def test_real_scheduler_builds_with_plugin_connector(plugin, make_engine, adapter):
    from hybrid_kv_plugin.adapters import Feature

    extra = {"cpu_bytes_to_use": 1 << 22}
    assert adapter.supports(Feature.FINE_GRAINED_CPU_HITS)  # backported on 0.26-0.29, native from 0.30
    engine = make_engine(kv_connector=CONNECTOR_NAME, kv_connector_extra_config=extra)
    assert type(engine.connector).__name__ == "HybridSimpleCPUConnector"
    assert engine.scheduler.hybrid_kv_config.mamba_shared_prefix_checkpoint is False
    engine.run([("a", tokens(320))], max_tokens=4)
    assert engine.reset_prefix_cache()
    hits = engine.run([("b", tokens(320) + [3, 4, 5])])
    # A prompt on the Mamba grid (5 x 64) is reused whole from the CPU tier on every wheel.
    assert hits == {"b": 320}
    assert engine.outcomes["b"].external_tokens == 320


def test_changed_patch_target_patches_nothing(no_plugin, monkeypatch, plugin_log, adapter):
    from vllm.v1.core.sched.scheduler import Scheduler

    original = inspect.getattr_static(Scheduler, "__init__")

    def renamed(self, config, kv_cache_config, structured_output_manager, block_size, hash_block_size=None):
        raise AssertionError("never called")

    monkeypatch.setattr(Scheduler, "__init__", renamed)
    hybrid_kv_plugin.register()

    assert registration.STATE.status == "mismatch"
    assert inspect.getattr_static(Scheduler, "__init__") is renamed
    assert CONNECTOR_NAME not in _registry()
    lines = plugin_log.messages(logging.WARNING)
    assert len(lines) == 1
    assert "vllm.v1.core.sched.scheduler:Scheduler.__init__" in lines[0]
    assert ">=0.26.0,<0.34.0" in lines[0]
    assert "nothing patched" in lines[0]
    monkeypatch.setattr(Scheduler, "__init__", original)


def test_register_and_doctor_take_one_decision(no_plugin, monkeypatch, capsys):
    """Disable switch and a changed target together: both say ``disabled`` (the switch is checked first)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from hybrid_kv_plugin.cli.main import main

    def renamed(self, config, kv_cache_config, structured_output_manager, block_size, hash_block_size=None):
        raise AssertionError("never called")

    monkeypatch.setattr(Scheduler, "__init__", renamed)
    monkeypatch.setenv("HYBRID_KV_PLUGIN_DISABLE", "1")
    hybrid_kv_plugin.register()
    assert (registration.STATE.status, registration.STATE.reason) == ("disabled", "HYBRID_KV_PLUGIN_DISABLE is set")
    assert main(["doctor", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "disabled"

    hybrid_kv_plugin.uninstall()
    monkeypatch.delenv("HYBRID_KV_PLUGIN_DISABLE")
    hybrid_kv_plugin.register()
    assert registration.STATE.status == "mismatch"
    assert main(["doctor", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["status"] == "mismatch"


def test_patch_set_is_all_or_nothing(no_plugin, adapter):
    from hybrid_kv_plugin.patching import PatchMismatch, PatchSpec

    good = patch_specs(adapter)
    owners = [(owner, attr, original) for _, owner, attr, original in _resolved(adapter)]
    missing = PatchSpec(
        name="renamed_attribute",
        target="vllm.v1.core.sched.scheduler:Scheduler._no_such_split",
        build=lambda original: original,
    )
    patch_set = PatchSet([*good, missing])
    assert [p.target for p in patch_set.check()] == [missing.target]
    with pytest.raises(PatchMismatch, match="_no_such_split not found"):
        patch_set.install()
    for owner, attr, original in owners:
        assert inspect.getattr_static(owner, attr) is original


def test_patches_of_one_target_stack_in_order_and_unwind_in_reverse(no_plugin, adapter):
    """A later patch of a target wraps the earlier one; a failure part-way rolls every patch back."""
    import dataclasses
    import functools

    from hybrid_kv_plugin.patching import PATCH_MARKER

    good = patch_specs(adapter)
    init = next(spec for spec in good if spec.name == "scheduler_plugin_config")
    owners = [(owner, attr, original) for _, owner, attr, original in _resolved(adapter)]
    stock_init = next(original for owner, attr, original in owners if attr == "__init__")

    def passthrough(original):
        return functools.wraps(original)(lambda *args, **kwargs: original(*args, **kwargs))

    outer = dataclasses.replace(init, name="outer_init", build=passthrough)
    patch_set = PatchSet([*good, outer])
    patch_set.install()
    from vllm.v1.core.sched.scheduler import Scheduler

    installed = inspect.getattr_static(Scheduler, "__init__")
    assert getattr(installed, PATCH_MARKER) == "outer_init"
    # 0.29+: divergence_bind wraps output_checkpoint_bind, which wraps the config patch of the constructor.
    init_chain, inner = [], installed.__wrapped__
    while is_patched(inner):
        init_chain.append(getattr(inner, PATCH_MARKER))
        inner = inner.__wrapped__
    names = {s.name for s in good}
    assert init_chain == [n for n in ("divergence_bind", "output_checkpoint_bind", "scheduler_plugin_config") if n in names]
    assert inner is stock_init
    # 0.29: the tail split wraps the junction split of the same method (0.26: which wraps the grid stop).
    split = inspect.getattr_static(Scheduler, "_mamba_block_aligned_split")
    wrappers = []
    while is_patched(split):
        wrappers.append(getattr(split, PATCH_MARKER))
        split = split.__wrapped__
    chain = ("prompt_tail_split", "junction_split", "mamba_split_keeps_block_grid")
    expected = [name for name in chain if name in {s.name for s in good}]
    assert wrappers == expected
    patch_set.uninstall()
    for owner, attr, original in owners:
        assert inspect.getattr_static(owner, attr) is original

    def fails(original):
        raise RuntimeError("replacement cannot be built")

    broken = PatchSet([*good, dataclasses.replace(outer, build=fails)])
    with pytest.raises(RuntimeError, match="cannot be built"):
        broken.install()
    for owner, attr, original in owners:
        assert inspect.getattr_static(owner, attr) is original


def test_disable_env_keeps_vllm_stock(no_plugin, monkeypatch, plugin_log, adapter):
    monkeypatch.setenv("HYBRID_KV_PLUGIN_DISABLE", "1")
    originals = [(owner, attr, original) for _, owner, attr, original in _resolved(adapter)]
    _load_through_vllm(monkeypatch)

    assert registration.STATE.status == "disabled"
    assert CONNECTOR_NAME not in _registry()
    for owner, attr, original in originals:
        assert inspect.getattr_static(owner, attr) is original
    assert plugin_log.messages() == [
        "hybrid-kv-plugin: disabled by HYBRID_KV_PLUGIN_DISABLE; vLLM runs stock"
    ]


@pytest.mark.parametrize(("allowed", "status"), [("some_other_plugin", "unregistered"), ("hybrid_kv", "active")])
def test_vllm_plugins_filter(no_plugin, monkeypatch, allowed, status):
    _load_through_vllm(monkeypatch, allowed)
    assert registration.STATE.status == status
    assert (CONNECTOR_NAME in _registry()) is (status == "active")


@pytest.mark.parametrize("version", ["0.25.1", "0.34.0", "1.0.0"])
def test_unsupported_wheel_is_inert_with_one_line(no_plugin, monkeypatch, plugin_log, version):
    import hybrid_kv_plugin.adapters as adapters

    monkeypatch.setattr(adapters, "installed_vllm", lambda: InstalledVllm(version, adapters.parse_release(version)))
    hybrid_kv_plugin.register()
    hybrid_kv_plugin.register()

    assert registration.STATE.status == "unsupported"
    assert CONNECTOR_NAME not in _registry()
    lines = plugin_log.messages()
    assert lines == [
        f"hybrid-kv-plugin: inert, vLLM {version} is outside the supported range >=0.26.0,<0.34.0; vLLM runs stock"
    ]


@pytest.mark.parametrize(
    ("name", "role", "sides"),
    [
        ("ApiServer_3", "api_server", set()),
        ("EngineCore", "engine_core", {"scheduler", "worker"}),
        ("EngineCore_DP2", "engine_core", {"scheduler", "worker"}),
        ("VllmWorker-7", "worker", {"worker"}),
        ("MainProcess", "any", {"scheduler", "worker", "frontend"}),
        ("SpawnProcess-1", "any", {"scheduler", "worker", "frontend"}),
    ],
)
def test_process_role_from_vllm_process_name(name, role, sides):
    from hybrid_kv_plugin.process_role import role_of

    assert role_of(name).value == role
    assert {side.value for side in role_of(name).sides} == sides
