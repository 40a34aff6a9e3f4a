"""The hybrid coordinator that owns the junction plan of one scheduler.

A subclass of the wheel's ``HybridKVCacheCoordinator``, installed as that module
global (``get_kv_cache_coordinator`` looks the name up at call time, so every
hybrid coordinator built afterwards - the scheduler's and any connector's - is
one). It computes the plan once when its scheduler binds it (:func:`plan_of`, at the
end of the scheduler's constructor). An open plan upgrades its Mamba managers to the
junction subclass, which gets the plan, and, under sparse retention, hands them the
EAGLE-aware replay boundaries on every ``cache_blocks`` call (without it, coordinator and
managers are bound to the stock ``cache_blocks``). A closed plan leaves the managers the
wheel's own and binds the stock ``cache_blocks`` on the coordinator, so the switch off
costs nothing per step. Unbound (a connector's CPU-side coordinator), it is the stock
coordinator.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MethodType
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.junction.gate import JunctionPlan, junction_plan, replay_boundaries
from hybrid_kv_plugin.junction.manager import adopt, junction_manager_class

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter


class JunctionCoordinatorMixin:
    """Marker + shared behaviour of every junction coordinator class (one per wheel)."""

    # None until the scheduler owning this coordinator binds it.
    junction_plan: JunctionPlan | None = None
    _junction_manager_cls: type
    _stock_mamba_manager_cls: type
    _stock_coordinator_cls: type
    _junction_adapter: VllmAdapter

    def bind_junction(self, switch: bool, divergence: bool, live_requests: Mapping[str, Any]) -> JunctionPlan:
        plan = junction_plan(switch, self, self._junction_adapter, divergence=divergence)
        self.junction_plan = plan
        if not plan.enabled:
            self.cache_blocks = MethodType(self._stock_coordinator_cls.cache_blocks, self)
            return plan
        for manager in self.single_type_managers:  # type: ignore[attr-defined]
            # Exactly the stock class: a manager some other plugin registered is left alone.
            if type(manager) is self._stock_mamba_manager_cls:
                adopt(manager, self._junction_manager_cls)
        managers = self._junction_managers()
        for manager in managers:
            manager.apply_plan(plan, live_requests)
        if self.retention_interval is None:  # type: ignore[attr-defined]
            # Without sparse retention there are no replay boundaries to hand over: both
            # cache_blocks overrides would pass straight through on every call. (The class swap
            # already moved the managers' attributes off inline storage: binding costs nothing.)
            self.cache_blocks = MethodType(self._stock_coordinator_cls.cache_blocks, self)
            for manager in managers:
                manager.cache_blocks = MethodType(self._stock_mamba_manager_cls.cache_blocks, manager)
        return plan

    def _junction_managers(self) -> list[Any]:
        return [m for m in self.single_type_managers if isinstance(m, self._junction_manager_cls)]  # type: ignore[attr-defined]


def junction_coordinator_class(stock: type, stock_mamba_manager: type, adapter: VllmAdapter) -> type:
    """Subclass the wheel's ``HybridKVCacheCoordinator`` (``stock``) for the junction checkpoint."""
    manager_cls = junction_manager_class(stock_mamba_manager, adapter)

    class JunctionHybridKVCacheCoordinator(JunctionCoordinatorMixin, stock):  # type: ignore[misc, valid-type]
        _junction_manager_cls = manager_cls
        _stock_mamba_manager_cls = stock_mamba_manager
        _stock_coordinator_cls = stock
        _junction_adapter = adapter

        # ``stock.cache_blocks`` rather than ``super()``: the same method (the mixin has
        # none), cheaper on a path that runs every step.
        def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
            plan = self.junction_plan
            if plan is None or not plan.enabled or self.retention_interval is None:
                return stock.cache_blocks(self, request, num_computed_tokens)
            bounds = replay_boundaries(
                request.num_prompt_tokens, self.scheduler_block_size, eagle=bool(self.eagle_group_ids)
            )
            managers = self._junction_managers()
            for manager in managers:
                manager.replay_handoff = bounds
            try:
                return stock.cache_blocks(self, request, num_computed_tokens)
            finally:
                for manager in managers:
                    manager.replay_handoff = None

    JunctionHybridKVCacheCoordinator.__qualname__ = JunctionHybridKVCacheCoordinator.__name__
    JunctionHybridKVCacheCoordinator.__module__ = __name__
    return JunctionHybridKVCacheCoordinator


NOT_HYBRID = JunctionPlan(enabled=False, reason="not a hybrid KV-cache coordinator")
# Where a scheduler keeps the plan once its coordinator is bound.
SCHEDULER_PLAN_ATTR = "hybrid_kv_junction_plan"


def plan_of(scheduler: Any) -> JunctionPlan:
    """The junction plan of ``scheduler``, binding its coordinator on first use.

    The switch lives on the scheduler (``hybrid_kv_config``, set before its stock
    constructor runs) but the coordinator is built inside that constructor, so the
    binding happens the first time the scheduler asks: at the end of that constructor
    (:mod:`hybrid_kv_plugin.inert_patches`), before any chunk is scheduled.
    """
    plan = scheduler.__dict__.get(SCHEDULER_PLAN_ATTR)
    if plan is not None:  # asked every prefill chunk; a bound plan never changes
        return plan
    coordinator = scheduler.kv_cache_manager.coordinator
    if not isinstance(coordinator, JunctionCoordinatorMixin):
        plan = NOT_HYBRID
    else:
        if coordinator.junction_plan is None:
            config = getattr(scheduler, "hybrid_kv_config", None)
            coordinator.bind_junction(
                bool(config and config.mamba_shared_prefix_checkpoint),
                divergence=bool(config and config.mamba_divergence_checkpoint),
                live_requests=scheduler.requests,
            )
        plan = coordinator.junction_plan
        assert plan is not None
    setattr(scheduler, SCHEDULER_PLAN_ATTR, plan)
    return plan
