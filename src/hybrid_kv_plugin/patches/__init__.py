"""The patch manifest: which patches of vLLM a wheel gets, in install order.

One module per patch. Each documents, where it lives, why the patch exists, what
it changes, the upstream change that makes it unnecessary, and the first vLLM
version on which the plugin no longer installs it. Each exports:

* ``INSTALLS`` - a :class:`hybrid_kv_plugin.patching.Installs`: the predicate over
  adapter facts that decides whether a wheel gets the patch, and the tested wheels
  that gives (``since``, ``removed_in``);
* ``FEATURE`` - the feature the patch serves (a key of
  :data:`hybrid_kv_plugin.adapters.capabilities.FEATURES`), ``"vllm_fix"`` for a standalone
  fix of a vLLM bug, or ``"plugin_config"``; ``hybrid-kv doctor`` groups patches by it;
* ``spec(adapter)`` - the :class:`hybrid_kv_plugin.patching.PatchSpec`: target,
  fingerprint, replacement, and the vLLM side that runs it; or, for one patch that
  must replace several attributes at once, ``specs(adapter)`` - their list, in
  install order (they go in with every other patch, or none go in).

``register()`` and ``hybrid-kv doctor`` ask :func:`patch_specs`; nothing else
decides which patches a wheel gets. Importing this package imports no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybrid_kv_plugin.adapters import ADAPTERS, parse_release
from hybrid_kv_plugin.patches import (
    admission_reserves_running_prefills,
    async_load_landing_reservation,
    async_load_liveness,
    boundary_handoff_publish,
    connector_hit_reconcile,
    divergence_attention_keys,
    divergence_bind,
    divergence_keys_after_preemption,
    finish_store_pinning,
    junction_coordinator,
    junction_reservation,
    junction_split,
    local_hit_admission,
    mamba_allocated_mark,
    mamba_boundary_handoffs,
    mamba_chunk_count_capped,
    mamba_split_keeps_block_grid,
    nixl_exchange_clip,
    nixl_save_meta,
    nixl_worker_pairing,
    offload_has_connector,
    output_checkpoint_bind,
    output_checkpoint_manager,
    output_checkpoint_offload,
    prompt_tail_attention,
    prompt_tail_keyed_once,
    prompt_tail_manager,
    prompt_tail_retention,
    prompt_tail_split,
    remaining_blocks_once_per_step,
    same_step_copy_chains,
    scheduler_plugin_config,
    step_stats_without_outputs,
    stock_store_skips_handed_on_mamba,
    truncate_mamba_lookup,
)

if TYPE_CHECKING:
    from types import ModuleType

    from hybrid_kv_plugin.adapters.base import VllmAdapter
    from hybrid_kv_plugin.patching import Installs, PatchSpec

# Install order: the plugin's own config first (it validates the switches the others read);
# the Mamba managers record boundary hand-offs before the scheduler publishes them.
# Patches of one target install in this order, each wrapping the one before (0.29:
# prompt_tail_split wraps junction_split; output_checkpoint_bind wraps scheduler_plugin_config and
# divergence_bind wraps both; output_checkpoint_manager wraps prompt_tail_manager, which wraps
# prompt_tail_keyed_once;
# divergence_attention_keys wraps prompt_tail_attention; admission_reserves_running_prefills wraps
# local_hit_admission's allocate_slots, outermost so that an engine it is inert for binds past it;
# junction_reservation wraps async_load_landing_reservation; remaining_blocks_once_per_step's schedule
# wraps async_load_liveness, outermost so that an engine it is inert for binds past it),
# and uninstall in reverse.
PATCH_MODULES: tuple[ModuleType, ...] = (
    scheduler_plugin_config,
    nixl_exchange_clip,
    nixl_save_meta,
    nixl_worker_pairing,
    connector_hit_reconcile,
    junction_coordinator,
    mamba_split_keeps_block_grid,
    junction_split,
    mamba_boundary_handoffs,
    mamba_allocated_mark,
    mamba_chunk_count_capped,
    boundary_handoff_publish,
    truncate_mamba_lookup,
    prompt_tail_keyed_once,
    prompt_tail_split,
    prompt_tail_manager,
    prompt_tail_retention,
    prompt_tail_attention,
    divergence_attention_keys,
    output_checkpoint_bind,
    divergence_bind,
    divergence_keys_after_preemption,
    output_checkpoint_manager,
    output_checkpoint_offload,
    finish_store_pinning,
    stock_store_skips_handed_on_mamba,
    offload_has_connector,
    async_load_liveness,
    async_load_landing_reservation,
    junction_reservation,
    same_step_copy_chains,
    local_hit_admission,
    admission_reserves_running_prefills,
    remaining_blocks_once_per_step,
    step_stats_without_outputs,
)


@dataclass(frozen=True)
class PlannedPatch:
    """One replaced attribute a wheel gets, with what its patch module declares about it."""

    spec: PatchSpec
    installs: Installs
    # The patch module's name (several entries share it when the patch replaces several attributes).
    patch: str
    # The feature it serves, "vllm_fix" or "plugin_config" (the module's FEATURE).
    feature: str

    @property
    def removed_in(self) -> str:
        """The first wheel without the patch, in words (``hybrid-kv doctor`` prints it)."""
        return removal_note(self.installs)


def planned_patches(adapter: VllmAdapter) -> list[PlannedPatch]:
    """Every patch this wheel gets, in install order (all installed, or none)."""
    return [
        PlannedPatch(spec, module.INSTALLS, module.__name__.rsplit(".", 1)[1], module.FEATURE)
        for module in PATCH_MODULES
        if module.INSTALLS.when(adapter)
        for spec in module_specs(module, adapter)
    ]


def module_specs(module: ModuleType, adapter: VllmAdapter) -> list[PatchSpec]:
    """The attributes one patch module replaces: ``specs(adapter)`` where it has several, else ``[spec(adapter)]``."""
    if hasattr(module, "specs"):
        return list(module.specs(adapter))
    return [module.spec(adapter)]


def patch_specs(adapter: VllmAdapter) -> list[PatchSpec]:
    return [planned.spec for planned in planned_patches(adapter)]


def removal_note(installs: Installs) -> str:
    """``0.30.0``; ``never``; ``never (installed on 0.33+)``; ``not yet (present up to 0.33.0)``."""
    if installs.removed_in is not None:
        return installs.removed_in
    if not installs.permanent:
        return f"not yet (present up to {ADAPTERS[-1].tested_wheels[-1]})"
    if installs.since == ADAPTERS[0].tested_wheels[0]:
        return "never"
    release = parse_release(installs.since)
    assert release is not None, installs.since
    return f"never (installed on {release[0]}.{release[1]}+)"


__all__ = ["PATCH_MODULES", "PlannedPatch", "module_specs", "patch_specs", "planned_patches", "removal_note"]
