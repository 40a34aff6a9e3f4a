"""Whether a scheduler asked for ``mamba_divergence_checkpoint``, and binding it to the scheduler's managers.

The option lives on the scheduler (``hybrid_kv_config``, validated and refused where
unsupported before its constructor ran); the managers that act on it are built
inside that constructor, so :func:`bind` runs after it. Managers never bound (option
off, a connector's CPU-side coordinator) keep the wheel's behaviour.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.divergence.native import open_native_gate
from hybrid_kv_plugin.junction.gate import JunctionPlan

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

# On full-attention managers keyed at every unit boundary (read with getattr: see
# hybrid_kv_plugin.patching.bypass_inert_patches for why never through ``__dict__``).
MANAGER_ATTR = "hybrid_kv_unit_keys"


def divergence_requested(scheduler: Any) -> bool:
    """The scheduler's option."""
    return bool(getattr(getattr(scheduler, "hybrid_kv_config", None), "mamba_divergence_checkpoint", False))


def bind(scheduler: Any, adapter: VllmAdapter) -> JunctionPlan | None:
    """Open the junction stop and state for the option; None when it is off.

    0.29: the junction backport's plan, bound by :func:`hybrid_kv_plugin.junction.plan_of`;
    0.30+: the wheel's own gate (:func:`~hybrid_kv_plugin.divergence.native.open_native_gate`).
    Where it opens, the full-attention managers that can be keyed inside a block are
    bound to unit keys (:mod:`.attention`), and ``HybridSimpleCPUConnector`` moves a
    request's divergence point to its CPU tier's attention reach (:mod:`.cpu_tier`).
    """
    if not divergence_requested(scheduler):
        return None
    if adapter.native_junction_manager_attr is None:
        from hybrid_kv_plugin.junction import plan_of

        plan = plan_of(scheduler)
    else:
        plan = open_native_gate(scheduler, adapter)
    if plan.enabled:
        from hybrid_kv_plugin.attention_partial_block import keyable_inside_blocks

        for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
            if keyable_inside_blocks(manager):
                setattr(manager, MANAGER_ATTR, True)
        # The plugin's CPU-tier connector also sets points from its lookups (cpu_tier.py).
        track = getattr(getattr(scheduler, "connector", None), "track_cpu_tier_divergence", None)
        if track is not None:
            track()
    return plan
