"""The patch manifest: every patch module documents itself, and what it declares is what gets installed."""

from __future__ import annotations

import pkgutil

import pytest

from hybrid_kv_plugin import patches
from hybrid_kv_plugin.adapters import ADAPTERS, parse_release
from hybrid_kv_plugin.patches import PATCH_MODULES, planned_patches, removal_note
from hybrid_kv_plugin.registration import decide

TESTED_WHEELS = [wheel for cls in ADAPTERS for wheel in cls.tested_wheels]
MODULES = {module.__name__.rsplit(".", 1)[1]: module for module in PATCH_MODULES}
# What `hybrid-kv doctor` prints as "removed in" for each patch.
REMOVAL_NOTES = {
    "scheduler_plugin_config": "never",
    "nixl_exchange_clip": "0.27.0",
    "nixl_save_meta": "0.27.0",
    "nixl_worker_pairing": "0.27.0",
    "junction_coordinator": "0.30.0",
    "connector_hit_reconcile": "0.27.0",
    "junction_split": "0.30.0",
    "junction_reservation": "0.30.0",
    "mamba_boundary_handoffs": "0.29.0",
    "boundary_handoff_publish": "0.29.0",
    "mamba_allocated_mark": "0.28.0",
    "truncate_mamba_lookup": "0.28.0",
    "prompt_tail_keyed_once": "0.32.0",
    "mamba_chunk_count_capped": "0.31.0",
    "prompt_tail_split": "not yet (present up to 0.33.0)",
    "prompt_tail_manager": "not yet (present up to 0.33.0)",
    "prompt_tail_retention": "not yet (present up to 0.33.0)",
    "prompt_tail_attention": "not yet (present up to 0.33.0)",
    "output_checkpoint_bind": "not yet (present up to 0.33.0)",
    "divergence_bind": "not yet (present up to 0.33.0)",
    "divergence_attention_keys": "not yet (present up to 0.33.0)",
    "divergence_keys_after_preemption": "not yet (present up to 0.33.0)",
    "output_checkpoint_manager": "not yet (present up to 0.33.0)",
    "output_checkpoint_offload": "not yet (present up to 0.33.0)",
    "finish_store_pinning": "not yet (present up to 0.33.0)",
    "offload_has_connector": "never (installed on 0.33+)",
    "async_load_liveness": "not yet (present up to 0.33.0)",
    "async_load_landing_reservation": "not yet (present up to 0.33.0)",
    "same_step_copy_chains": "not yet (present up to 0.33.0)",
    "local_hit_admission": "not yet (present up to 0.33.0)",
    "admission_reserves_running_prefills": "not yet (present up to 0.33.0)",
    "remaining_blocks_once_per_step": "not yet (present up to 0.33.0)",
    "step_stats_without_outputs": "0.28.0",
    "stock_store_skips_handed_on_mamba": "0.30.0",
    "mamba_split_keeps_block_grid": "0.27.0",
}


def test_every_patch_module_is_in_the_manifest():
    on_disk = sorted(info.name for info in pkgutil.iter_modules(patches.__path__))
    assert on_disk == sorted(MODULES) == sorted(REMOVAL_NOTES)


@pytest.mark.parametrize("name", list(MODULES))
def test_docstring_has_why_what_upstream(name):
    doc = MODULES[name].__doc__
    for section in ("\nWhy: ", "\nWhat it changes", "\nUpstream: "):
        assert section in doc, f"{name}: no {section.strip()!r} section"
    assert doc.index("\nWhy: ") < doc.index("\nWhat it changes") < doc.index("\nUpstream: ")


@pytest.mark.parametrize("name", list(MODULES))
def test_declared_range_is_supported_and_in_the_docstring(name):
    installs = MODULES[name].INSTALLS
    assert installs.since in TESTED_WHEELS
    if installs.removed_in is None:
        assert installs.since in MODULES[name].__doc__
    else:
        # A release of a supported family, at or below the wheel tested for it (0.27.0 for 0.27.1).
        removed = parse_release(installs.removed_in)
        assert any(removed[:2] == parse_release(w)[:2] and removed <= parse_release(w) for w in TESTED_WHEELS)
        assert parse_release(installs.since) < parse_release(installs.removed_in)
        assert not installs.permanent
        assert installs.removed_in in MODULES[name].__doc__
    assert removal_note(installs) == REMOVAL_NOTES[name]


@pytest.mark.parametrize("name", list(MODULES))
def test_installed_here_exactly_when_the_declared_range_says(adapter, name):
    """Across the 8-wheel suite: the manifest agrees with each ``since`` / ``removed_in`` on every wheel."""
    installs = MODULES[name].INSTALLS
    here = parse_release(adapter.version)
    in_range = parse_release(installs.since) <= here and (
        installs.removed_in is None or here < parse_release(installs.removed_in)
    )
    assert installs.when(adapter) is in_range
    assert (name in [planned.patch for planned in planned_patches(adapter)]) is in_range


# The patches each wheel gets, by module (one row per tested wheel).
PLANNED_BY_WHEEL = {
    "0.26.0": [
        "scheduler_plugin_config", "nixl_exchange_clip", "nixl_save_meta", "nixl_worker_pairing",
        "connector_hit_reconcile", "junction_coordinator", "mamba_split_keeps_block_grid", "junction_split", "mamba_boundary_handoffs",
        "mamba_allocated_mark", "mamba_chunk_count_capped", "boundary_handoff_publish", "prompt_tail_keyed_once", "stock_store_skips_handed_on_mamba", "async_load_landing_reservation", "junction_reservation", "same_step_copy_chains", "local_hit_admission", "admission_reserves_running_prefills", "remaining_blocks_once_per_step", "step_stats_without_outputs",
    ],
    "0.27.1": [
        "scheduler_plugin_config", "junction_coordinator", "junction_split", "mamba_boundary_handoffs",
        "mamba_allocated_mark", "mamba_chunk_count_capped", "boundary_handoff_publish", "truncate_mamba_lookup", "prompt_tail_keyed_once", "stock_store_skips_handed_on_mamba", "async_load_landing_reservation", "junction_reservation", "same_step_copy_chains", "local_hit_admission", "admission_reserves_running_prefills", "remaining_blocks_once_per_step", "step_stats_without_outputs",
    ],
    "0.28.0": [
        "scheduler_plugin_config", "junction_coordinator", "junction_split", "mamba_boundary_handoffs",
        "mamba_chunk_count_capped", "boundary_handoff_publish", "prompt_tail_keyed_once", "stock_store_skips_handed_on_mamba", "async_load_landing_reservation", "junction_reservation", "same_step_copy_chains", "local_hit_admission", "admission_reserves_running_prefills", "remaining_blocks_once_per_step",
    ],
    "0.29.0": [
        "scheduler_plugin_config", "junction_coordinator", "junction_split", "mamba_chunk_count_capped", "prompt_tail_keyed_once", "prompt_tail_split",
        "prompt_tail_manager", "prompt_tail_attention", "divergence_attention_keys", "output_checkpoint_bind",
        "divergence_bind", "divergence_keys_after_preemption", "output_checkpoint_manager", "stock_store_skips_handed_on_mamba", "async_load_liveness", "async_load_landing_reservation", "junction_reservation", "same_step_copy_chains", "local_hit_admission", "admission_reserves_running_prefills", "remaining_blocks_once_per_step",
    ],
    "0.30.0": [
        "scheduler_plugin_config", "mamba_chunk_count_capped", "prompt_tail_keyed_once", "prompt_tail_split", "prompt_tail_manager", "prompt_tail_retention", "prompt_tail_attention",
        "divergence_attention_keys", "output_checkpoint_bind", "divergence_bind", "divergence_keys_after_preemption",
        "output_checkpoint_manager", "output_checkpoint_offload", "finish_store_pinning", "async_load_liveness", "async_load_landing_reservation", "same_step_copy_chains", "local_hit_admission", "admission_reserves_running_prefills", "remaining_blocks_once_per_step",
    ],
    "0.31.0": [
        "scheduler_plugin_config", "prompt_tail_keyed_once", "prompt_tail_split", "prompt_tail_manager", "prompt_tail_retention", "prompt_tail_attention",
        "divergence_attention_keys", "output_checkpoint_bind", "divergence_bind", "divergence_keys_after_preemption",
        "output_checkpoint_manager", "output_checkpoint_offload", "finish_store_pinning", "async_load_liveness", "async_load_landing_reservation", "same_step_copy_chains", "local_hit_admission", "admission_reserves_running_prefills", "remaining_blocks_once_per_step",
    ],
    "0.32.0": [
        "scheduler_plugin_config", "prompt_tail_split", "prompt_tail_manager", "prompt_tail_retention", "prompt_tail_attention",
        "divergence_attention_keys", "output_checkpoint_bind", "divergence_bind", "divergence_keys_after_preemption",
        "output_checkpoint_manager", "output_checkpoint_offload", "finish_store_pinning", "async_load_liveness", "async_load_landing_reservation", "same_step_copy_chains", "local_hit_admission", "admission_reserves_running_prefills", "remaining_blocks_once_per_step",
    ],
    "0.33.0": [
        "scheduler_plugin_config", "prompt_tail_split", "prompt_tail_manager", "prompt_tail_retention", "prompt_tail_attention",
        "divergence_attention_keys", "output_checkpoint_bind", "divergence_bind", "divergence_keys_after_preemption",
        "output_checkpoint_manager", "output_checkpoint_offload", "finish_store_pinning", "offload_has_connector", "async_load_liveness", "async_load_landing_reservation", "same_step_copy_chains", "local_hit_admission", "admission_reserves_running_prefills", "remaining_blocks_once_per_step",
    ],
}


def test_each_wheel_gets_exactly_these_patches(adapter):
    planned = [planned.patch for planned in planned_patches(adapter)]
    assert list(dict.fromkeys(planned)) == PLANNED_BY_WHEEL[adapter.version]


def test_a_patch_of_several_attributes_is_planned_whole(adapter):
    """``mamba_boundary_handoffs`` replaces four MambaManager methods: all four are planned, or none."""
    names = [planned.spec.name for planned in planned_patches(adapter) if planned.patch == "mamba_boundary_handoffs"]
    expected = [
        "mamba_boundary_handoffs.cache_blocks",
        "mamba_boundary_handoffs.allocate_new_blocks",
        "mamba_boundary_handoffs.pop_blocks_for_free",
        "mamba_boundary_handoffs.new_step_starts",
    ]
    assert names == (expected if adapter.boundary_handoff_patch_needed else [])


def test_registration_installs_what_the_manifest_plans(no_plugin, adapter, monkeypatch):
    monkeypatch.delenv("HYBRID_KV_PLUGIN_DISABLE", raising=False)
    decision = decide()
    assert decision.status == "active"
    assert [spec.name for spec in decision.specs] == [p.spec.name for p in planned_patches(adapter)]
    # Install order follows the manifest; a patch's several attributes go in one after another.
    patches_in_order = [planned.patch for planned in planned_patches(adapter)]
    assert patches_in_order == sorted(patches_in_order, key=list(MODULES).index)
