"""The Mamba manager that keeps a partial state at the junction (and the lowered EAGLE tail).

Built at install time as a subclass of the wheel's own ``MambaManager``. The
plugin never registers it in vLLM's KV-cache spec registry: vLLM re-registers
``MambaSpec -> MambaManager`` at every engine start and asserts on any other
manager. Instead the junction coordinator upgrades the Mamba managers it owns
(:func:`adopt`), so the registry keeps naming the stock class.

While its coordinator has not opened the gate (switch off, or no plan yet), every
method is the stock one: the class only adds behaviour behind ``junction_enabled``.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from itertools import compress
from types import MappingProxyType, MethodType
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.junction.gate import JunctionPlan, lowered_tail
from hybrid_kv_plugin.mamba_partial_state import keep_partial_state
from hybrid_kv_plugin.patching import past_inert_patches
from hybrid_kv_plugin.request_fields import computed_tokens_of
from hybrid_kv_plugin.scheduler_kind import outputs_arrive_late

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

_junction = operator.attrgetter("shared_prefix_boundary")


def junction_manager_class(stock: type, adapter: VllmAdapter) -> type:
    """The subclass of ``stock`` (the wheel's ``MambaManager``) for this wheel."""
    return _build(stock, tracks_producers=adapter.mamba_tracks_partial_tail_producers)


def adopt(manager: Any, cls: type) -> None:
    """Turn a stock Mamba manager the coordinator just built into the junction subclass.

    The subclass adds no constructor state (its switches are class-level defaults),
    so swapping the class of a fully built stock instance is exact.
    """
    manager.__class__ = cls


def _build(stock: type, tracks_producers: bool) -> type:
    class JunctionMambaManager(stock):  # type: ignore[misc, valid-type]
        """``MambaManager`` that also checkpoints a partial state at the shared-prefix junction."""

        # Set by the coordinator from its JunctionPlan; class defaults keep stock behaviour.
        junction_enabled = False
        lowers_prompt_tail = False
        # The hash unit while junction_enabled, else 0: the partial-tail call tests its grid inline.
        added_checkpoint_unit = 0
        # Replay boundaries handed over by the coordinator for the cache_blocks call in flight.
        replay_handoff: tuple[int, ...] | None = None
        # The owning scheduler's live requests by id (set with the plan): the block counts
        # vLLM asks for get only an id.
        live_requests: Mapping[str, Any] = MappingProxyType({})

        def apply_plan(self, plan: JunctionPlan, live_requests: Mapping[str, Any]) -> None:
            # Only an align manager whose block is coarser than the hash unit has sub-block
            # positions to keep; decided once here rather than on every cached chunk.
            self.junction_enabled = (
                plan.enabled and self.mamba_cache_mode == "align" and self.block_size > self.block_pool.hash_block_size
            )
            self.lowers_prompt_tail = self.junction_enabled and plan.lowered_tail and self.use_eagle
            self.added_checkpoint_unit = self.block_pool.hash_block_size if self.junction_enabled else 0
            self.live_requests = live_requests

        # Stock methods are looked up on ``stock`` at call time, not via ``super()`` (the
        # same method: this class adds nothing between) - cheaper, and they run every step.
        # Call time, because other patches replace ``stock._cache_partial_tail_block``.
        def cache_blocks(self, request: Any, num_tokens: int, retention_interval: int | None = None) -> None:
            handoff = self.replay_handoff
            if handoff is None or retention_interval is None:
                return stock.cache_blocks(self, request, num_tokens, retention_interval=retention_interval)
            # Sparse retention keeps only states at "reachable" positions; the wheel knows
            # the last prompt token and the junction. Under EAGLE a replay resumes one block
            # lower, so add those positions for this one call (an instance attribute shadows
            # the class-level mask builder, which vLLM also calls on the class elsewhere).
            stock_mask = type(self).reachable_block_mask

            def mask_with_replay(**kwargs: Any) -> Any:
                kwargs["reachable_boundaries"] = [*kwargs.get("reachable_boundaries", ()), *handoff]
                return stock_mask(**kwargs)

            self.reachable_block_mask = mask_with_replay
            try:
                return stock.cache_blocks(self, request, num_tokens, retention_interval=retention_interval)
            finally:
                del self.reachable_block_mask

        _cache_partial_tail_block = _partial_tail_method(stock, None)
        get_num_blocks_to_allocate = _admission_count_method(stock, None)

        def _junction_block_owed(self, request_id: str, total_computed_tokens: int) -> int:
            """1 if the request's remaining prompt keeps a state this class adds, else 0.

            Such a state (the junction, the EAGLE-lowered prompt tail) stays in the block its
            chunk ends in, and the chunk after it copies it into a new block before the kept
            one is released: one block more than the wheel's whole-prompt count (the admission
            check) expects. One block whatever their number: each copy releases its source.
            """
            request = self.live_requests.get(request_id)
            if request is None:
                return 0
            # _is_added_checkpoint bounds both positions by the prompt; the hit is the lower bound here.
            junction = request.shared_prefix_boundary
            if total_computed_tokens < junction and self._is_added_checkpoint(request, junction):
                return 1
            if self.lowers_prompt_tail:
                tail = lowered_tail(request.num_prompt_tokens, self.block_pool.hash_block_size)
                return int(total_computed_tokens < tail and self._is_added_checkpoint(request, tail))
            return 0

        def _is_added_checkpoint(self, request: Any, num_tokens: int) -> bool:
            # Asked only with ``junction_enabled``: an align manager with sub-block hash positions.
            unit = self.added_checkpoint_unit
            # Only sub-block positions on the hash grid: block ends are full-block entries.
            if num_tokens % unit or num_tokens % self.block_size == 0:
                return False
            if self.lowers_prompt_tail and num_tokens == lowered_tail(request.num_prompt_tokens, unit):
                # Only for the chunk that ends there, as for the junction below.
                return request.num_computed_tokens < num_tokens
            # The junction, only for the prompt chunk that ends there: during decode the
            # block is the running state, rewritten in place, so its key would lie.
            return (
                num_tokens == request.shared_prefix_boundary
                and request.num_computed_tokens < num_tokens <= request.num_prompt_tokens
            )

        def _checkpoint_partial_state(self, request: Any, num_tokens: int) -> Any:
            # 0.27+ also offer the copy to a connector as this request's boundary state.
            return keep_partial_state(self, request, num_tokens, False if tracks_producers else None)

    JunctionMambaManager.hybrid_kv_stock_class = stock
    JunctionMambaManager.__qualname__ = JunctionMambaManager.__name__
    JunctionMambaManager.__module__ = __name__
    return JunctionMambaManager


def _partial_tail_method(stock: type, next_method: Any) -> Any:
    """The junction's ``_cache_partial_tail_block``, falling through to ``next_method``.

    ``None``: the wheel's method as patched, looked up at each call (other patches
    replace ``stock._cache_partial_tail_block`` after this class is built).
    """

    def _cache_partial_tail_block(self: Any, request: Any, num_tokens: int) -> Any:
        # Called at every cached chunk end and decode, mostly off the hash grid: that test runs
        # here, before a call (the unit is 0 while the junction is closed).
        unit = self.added_checkpoint_unit
        if unit and not num_tokens % unit and self._is_added_checkpoint(request, num_tokens):
            return self._checkpoint_partial_state(request, num_tokens)
        return (next_method or stock._cache_partial_tail_block)(self, request, num_tokens)

    _cache_partial_tail_block.falls_through_to = next_method  # type: ignore[attr-defined]
    return _cache_partial_tail_block


def _admission_count_method(stock: type, next_method: Any) -> Any:
    """The junction's ``get_num_blocks_to_allocate``, falling through to ``next_method``.

    The admission check (``apply_admission_cap``: whole prompt, or an in-flight prefill's
    reservation) also counts the block a junction state inside the remaining prompt keeps.
    Without it two requests admitted into the last free blocks each need one more after
    their junction chunk; under ``AsyncScheduler`` (0.28+ defers a preempted request's
    blocks a step) each preemption frees nothing and both restart for ever (soak
    ``plugin-divergence-fa64``, 0.29, async: seeds 5, 20, 22). Per-chunk counts already
    include it (the kept state makes the next chunk a partial hit). Bound only under
    ``AsyncScheduler`` (:func:`bind_past_inert_patches`).
    ``None``: the wheel's method as patched, looked up at each call.
    """

    def get_num_blocks_to_allocate(
        self: Any,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Any,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
    ) -> int:
        count = (next_method or stock.get_num_blocks_to_allocate)(
            self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
            num_local_computed_tokens, num_tokens_main_model, apply_admission_cap,
        )
        if apply_admission_cap and self.junction_enabled:
            return count + self._junction_block_owed(request_id, total_computed_tokens)
        return count

    get_num_blocks_to_allocate.falls_through_to = next_method  # type: ignore[attr-defined]
    return get_num_blocks_to_allocate


def owes_junction_blocks(kv_cache_manager: Any) -> bool:
    """Whether any of ``kv_cache_manager``'s groups is an enabled junction manager (fixed once its plan is bound)."""
    return any(getattr(m, "junction_enabled", False) for m in kv_cache_manager.coordinator.single_type_managers)


def reservation_owed_blocks(kv_cache_manager: Any, requests: Iterable[Any]) -> int:
    """Blocks the junction states inside ``requests``' remaining prompts keep, over every enabled junction manager.

    What the admission count adds under ``AsyncScheduler`` (:func:`_admission_count_method`), asked
    once per reservation sum instead (patches/junction_reservation.py). Without a lowered tail only
    requests still below their junction can owe: they are picked out in C (most are past it).
    """
    requests = list(requests)
    owed = 0
    for manager in kv_cache_manager.coordinator.single_type_managers:
        if not getattr(manager, "junction_enabled", False):
            continue
        candidates = (
            requests
            if manager.lowers_prompt_tail
            else compress(requests, map(operator.lt, map(computed_tokens_of, requests), map(_junction, requests)))
        )
        owed += sum(manager._junction_block_owed(r.request_id, r.num_computed_tokens) for r in candidates)
    return owed


def is_junction_manager(manager: Any) -> bool:
    """Whether ``manager`` was adopted by a junction coordinator (:func:`adopt`)."""
    return getattr(type(manager), "hybrid_kv_stock_class", None) is not None


def bind_past_inert_patches(manager: Any, scheduler: Any) -> int:
    """Bind ``manager``'s overrides to fall through past the wheel-method patches inert for it.

    For an adopted junction manager only: the class swap already moved its attributes
    off inline storage, so an instance binding costs nothing there (hybrid_kv_plugin.inert_patches).
    The admission count is kept only under ``AsyncScheduler``: under ``Scheduler`` a
    preempted request's blocks come back at once, so the wheel's count costs at most a
    preemption (as the wheel's own chunk stops do), and a count runs per request per step.
    Returns how many methods were bound.
    """
    stock = type(manager).hybrid_kv_stock_class
    bound = 0
    overrides = [("_cache_partial_tail_block", _partial_tail_method)]
    if outputs_arrive_late(scheduler):
        overrides.append(("get_num_blocks_to_allocate", _admission_count_method))
    else:
        count = past_inert_patches(stock.get_num_blocks_to_allocate, manager, scheduler)
        manager.get_num_blocks_to_allocate = MethodType(count, manager)  # the wheel's count, past inert patches
        bound += 1
    for attr, build in overrides:
        patched = getattr(stock, attr)
        target = past_inert_patches(patched, manager, scheduler)
        if target is not patched:
            setattr(manager, attr, MethodType(build(stock, target), manager))
            bound += 1
    return bound
