"""Per engine: vLLM's own methods wherever a plugin option is off for that engine.

Patches go in once per process, but the options that drive them are per engine
(``additional_config['hybrid_kv']``), and their targets run on every scheduler step.
At the end of the scheduler constructor (``scheduler_plugin_config``), the per-step
methods of the scheduler and of its KV-cache managers are bound, on those objects,
past the patches that are inert for them (:func:`~hybrid_kv_plugin.patching.bypass_inert_patches`,
each patch's ``inert_for``). Options never change after start-up, so neither does that.
"""

from __future__ import annotations

from typing import Any

from hybrid_kv_plugin.patching import bypass_inert_patches

# Patched methods that run per request per step, with a per-engine option.
SCHEDULER_METHODS = ("_mamba_block_aligned_split",)
MANAGER_METHODS = ("_cache_partial_tail_block",)


def bypass_inert_patches_of(scheduler: Any) -> None:
    from hybrid_kv_plugin.junction import plan_of

    # Bound first: an open junction plan re-types the Mamba managers (their own
    # override then decides), which must happen before anything is bound on them.
    plan_of(scheduler)
    for attr in SCHEDULER_METHODS:
        bypass_inert_patches(scheduler, attr, scheduler)
    coordinator = getattr(getattr(scheduler, "kv_cache_manager", None), "coordinator", None)
    for manager in getattr(coordinator, "single_type_managers", ()):
        for attr in MANAGER_METHODS:
            bypass_inert_patches(manager, attr, scheduler)
