"""Per engine: vLLM's own methods wherever a plugin option is off for that engine.

Patches go in once per process, but the options that drive them are per engine
(``additional_config['hybrid_kv']``), and their targets run on every scheduler step.
At the end of the scheduler constructor (``scheduler_plugin_config``), the scheduler's
per-step methods are bound, on the scheduler, past the patches that are inert for it
(:func:`~hybrid_kv_plugin.patching.bypass_inert_patches`, each patch's ``inert_for``).
Options never change after start-up, so neither does that.

Only the scheduler: it already holds more attributes than CPython keeps inline, so one
more costs nothing. A KV-cache manager keeps its attributes inline, and a class shares
fewer free inline slots with each instance it creates; an attribute added later can move
all of that manager's attributes to the slow path (with the plugin's other such cases,
machine instructions per scheduler step on 0.29, plugin / stock: 1.137 before, 1.092
after). Their patches check the manager's binding on each call instead.
"""

from __future__ import annotations

from typing import Any

from hybrid_kv_plugin.patching import bypass_inert_patches

# Patched methods that run per request per step, with a per-engine option.
SCHEDULER_METHODS = ("_mamba_block_aligned_split",)


def bypass_inert_patches_of(scheduler: Any) -> None:
    from hybrid_kv_plugin.junction import plan_of

    # Bound first: an open junction plan re-types the Mamba managers (their own
    # override then decides), which must happen before anything is bound.
    plan_of(scheduler)
    for attr in SCHEDULER_METHODS:
        bypass_inert_patches(scheduler, attr, scheduler)
