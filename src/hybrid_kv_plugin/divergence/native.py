"""Opening the wheel's own junction gate without EAGLE (vLLM 0.30+).

From 0.30 the wheel has both halves of the junction checkpoint: the split ends a
chunk exactly at ``request.shared_prefix_boundary`` while the scheduler's gate
attribute is set, and a Mamba manager whose own attribute is set keeps the partial
state there. The ``KVCacheManager`` sets all three only with an EAGLE group. Nothing
in either half depends on EAGLE: the junction is the longest single-group hit, with
or without a drafter. So after the stock constructor the plugin sets them itself,
under the same gate the 0.29 backport uses (:func:`hybrid_kv_plugin.junction.junction_plan`).
The attributes exist from the constructor on: setting them adds none.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.junction.gate import JunctionPlan, junction_plan
from hybrid_kv_plugin.patching import Fingerprint

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter


def open_native_gate(scheduler: Any, adapter: VllmAdapter) -> JunctionPlan:
    """Set the wheel's junction attributes on ``scheduler``, its KV-cache manager and its align Mamba managers.

    Returns the plan; a closed one (partial hash hits off, a re-prefill tail, no
    partial-cache split) leaves every attribute as the wheel set it.
    """
    manager = scheduler.kv_cache_manager
    coordinator = manager.coordinator
    plan = junction_plan(False, coordinator, adapter, divergence=True)
    if not plan.enabled:
        return plan
    if not scheduler.mamba_partial_cache_hit:
        # The wheel reads its junction stop only inside the split for partial hits.
        return JunctionPlan(enabled=False, reason="no align-mode Mamba split for partial hits")
    attr = adapter.native_junction_scheduler_attr
    assert attr is not None and adapter.native_junction_manager_attr is not None
    setattr(manager, attr, True)
    setattr(scheduler, attr, True)
    for single in coordinator.single_type_managers:
        if getattr(single, "mamba_cache_mode", None) == "align":
            setattr(single, adapter.native_junction_manager_attr, True)
    return plan


@dataclass(frozen=True)
class NativeGateFingerprint(Fingerprint):
    """``Fingerprint`` of ``Scheduler.__init__``, plus: the constructors still store the gate attributes.

    Setting an attribute a constructor no longer stores would silently do nothing.
    """

    gate_attr: str = ""
    manager_attr: str = ""

    def check(self, original: Any, owner: Any) -> str | None:
        if reason := super().check(original, owner):
            return reason
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

        expected = (
            (original, (self.gate_attr, "mamba_partial_cache_hit")),
            (KVCacheManager.__init__, (self.gate_attr,)),
            (SingleTypeKVCacheManager.__init__, (self.manager_attr,)),
        )
        for init, names in expected:
            stored = inspect.unwrap(init).__code__.co_names
            if missing := [name for name in names if name not in stored]:
                return f"{init.__qualname__} no longer sets {', '.join(missing)}"
        return None
