"""Per engine: vLLM's own methods wherever a plugin option is off for that engine.

Patches go in once per process, but the options that drive them are per engine
(``additional_config['hybrid_kv']``), and their targets run on every scheduler step.
At the end of the scheduler constructor (``scheduler_plugin_config``), per-step methods
are bound, on the object that runs them, past the patches that are inert for it
(:func:`~hybrid_kv_plugin.patching.bypass_inert_patches`, each patch's ``inert_for``).
Options never change after start-up, so neither does that.

Only objects whose attributes are already off CPython's inline storage get a binding:
the scheduler on every wheel, the Mamba managers where the wheel's own constructor
gives them more attributes than CPython keeps inline (0.30+, the adapter says), and
the junction's re-typed Mamba managers (every wheel; their override falls through to
the innermost patch that is not inert). The exceptions, the ``KVCacheManager`` and its
GPU ``BlockPool`` (one each per scheduler), keep their attributes inline with the one
method bound on each (measured: attribute reads on them take as long after the binding
as before; the pool, 0.29 and 0.33: 1.000 and 1.005 times). Elsewhere
a KV-cache manager keeps its attributes inline, and a class shares fewer free inline
slots with each instance it creates; an attribute added later can move all of that
manager's attributes to the slow path (with the plugin's other such cases, machine
instructions per scheduler step on 0.29, plugin / stock: 1.137 before, 1.092 after).
Their patches check the manager's binding on each call instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.patching import bypass_inert_patches
from hybrid_kv_plugin.scheduler_kind import note_scheduler

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

# Patched methods that run per request per step (the second: per async admission; the third: per
# step; the fourth: per in-flight prefill per admission), with a per-engine option.
SCHEDULER_METHODS = ("_mamba_block_aligned_split", "_inflight_prefill_reserved_blocks", "schedule", "_request_remaining_blocks")
# Patched Mamba-manager methods that run per group per step (cache_blocks calls the second; the
# scheduler's block counts call the third).
MAMBA_MANAGER_METHODS = ("cache_blocks", "_cache_partial_tail_block", "get_num_blocks_to_allocate")
# Patched KVCacheManager methods that run per request per step.
KV_CACHE_MANAGER_METHODS = ("allocate_slots",)
# Patched methods of the engine's GPU BlockPool that run per group per request per step.
BLOCK_POOL_METHODS = ("cache_full_blocks",)


def bypass_inert_patches_of(scheduler: Any, adapter: VllmAdapter) -> None:
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    from hybrid_kv_plugin.junction import plan_of
    from hybrid_kv_plugin.junction.manager import bind_past_inert_patches, is_junction_manager

    note_scheduler(scheduler)
    # Bound first: an open junction plan re-types the Mamba managers (their own
    # override then decides), which must happen before anything is bound.
    plan_of(scheduler)
    for attr in SCHEDULER_METHODS:
        bypass_inert_patches(scheduler, attr, scheduler)
    for attr in KV_CACHE_MANAGER_METHODS:
        bypass_inert_patches(scheduler.kv_cache_manager, attr, scheduler)
    for attr in BLOCK_POOL_METHODS:
        bypass_inert_patches(scheduler.kv_cache_manager.block_pool, attr, scheduler)
    if adapter.prompt_tail_checkpoint_supported:
        from hybrid_kv_plugin.prompt_tail.binding import policy_of

        # The prompt-tail policy binds its managers on first use; the manager patches'
        # ``inert_for`` read that binding, so it must exist before they are asked.
        policy_of(scheduler, adapter)
    for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
        if is_junction_manager(manager):
            # Re-typed, so off inline storage on every wheel: its override falls through
            # past the wheel-method patches inert for it.
            bind_past_inert_patches(manager, scheduler)
        elif adapter.mamba_manager_attributes_past_inline and isinstance(manager, MambaManager):
            for attr in MAMBA_MANAGER_METHODS:
                bypass_inert_patches(manager, attr, scheduler)
