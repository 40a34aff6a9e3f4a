"""What kind of vLLM scheduler an engine runs, for rules that only one kind needs."""

from __future__ import annotations

import weakref
from typing import Any

# The KV-cache managers (GPU side) of every AsyncScheduler built with the plugin: per-group code
# asks here rather than getting an attribute (0.26-0.29 managers keep theirs inline).
_ASYNC_SCHEDULERS_MANAGERS: weakref.WeakSet[Any] = weakref.WeakSet()
# KVCacheManager -> its scheduler, for schedulers whose admissions reserve the running
# prefills' blocks (patches/admission_reserves_running_prefills.py). Weak both ways: the
# scheduler owns its manager.
_RESERVING_SCHEDULERS: weakref.WeakKeyDictionary[Any, weakref.ref[Any]] = weakref.WeakKeyDictionary()
# GPU block pool id -> (a weak reference to it, to tell a reused id; the attention groups whose full
# blocks a prefix hit can end inside). Only engines whose EAGLE-family drafter drops one prefix-match
# unit off a hit, on attention blocks coarser than that unit (patches/local_hit_admission.py).
HIT_INSIDE_FULL_BLOCKS: dict[int, tuple[weakref.ref[Any], frozenset[int]]] = {}


def outputs_arrive_late(scheduler: Any) -> bool:
    """Whether ``scheduler`` is vLLM's ``AsyncScheduler``: only it gives requests output placeholders."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    return isinstance(scheduler, AsyncScheduler)


def note_scheduler(scheduler: Any) -> None:
    """Remember ``scheduler``'s KV-cache managers if it is an ``AsyncScheduler`` (at the end of its constructor)."""
    if outputs_arrive_late(scheduler):
        _ASYNC_SCHEDULERS_MANAGERS.update(scheduler.kv_cache_manager.coordinator.single_type_managers)
    if reserves_running_prefills(scheduler):
        _RESERVING_SCHEDULERS[scheduler.kv_cache_manager] = weakref.ref(scheduler)
    pool = scheduler.kv_cache_manager.block_pool
    groups = groups_hit_inside_full_blocks(scheduler)
    if groups:
        HIT_INSIDE_FULL_BLOCKS[id(pool)] = (weakref.ref(pool), groups)
    else:
        HIT_INSIDE_FULL_BLOCKS.pop(id(pool), None)


def drafts_with_eagle(scheduler: Any) -> bool:
    """Whether ``scheduler``'s engine drafts with an EAGLE-family method (EAGLE, EAGLE3, MTP, ...):
    its prefix hits drop the drafter's last unit, and its split lowers the last cacheable block."""
    return bool(getattr(scheduler, "use_eagle", False))


def groups_hit_inside_full_blocks(scheduler: Any) -> frozenset[int]:
    """The attention groups of ``scheduler`` whose full blocks a prefix hit can end inside, on blocks
    coarser than the prefix-match unit: under EAGLE (the drafter's last unit is recomputed), or with
    more than one KV-cache group, where the hit ends at the deepest position every group has (a
    hybrid model's Mamba state at a unit boundary inside an attention block the lookup found whole)."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    if not drafts_with_eagle(scheduler) and len(managers) < 2:
        return frozenset()
    unit = scheduler.kv_cache_manager.block_pool.hash_block_size
    return frozenset(
        m.kv_cache_group_id for m in managers if isinstance(m, FullAttentionManager) and m.block_size > unit
    )


def frees_deferred(scheduler: Any) -> bool:
    """Whether ``scheduler`` frees a finished or preempted request's blocks only a step later.

    vLLM sets ``defer_block_free`` when batches overlap (``AsyncScheduler``, pipeline
    parallelism) and a connector loads KV into the GPU blocks.
    """
    return bool(getattr(scheduler, "defer_block_free", False))


def reserves_running_prefills(scheduler: Any) -> bool:
    """Whether ``scheduler``'s admissions keep free what its running prefills still need.

    An ``AsyncScheduler`` with deferred frees only (a preemption there frees nothing in
    time), and only with the plugin's ``async_load_liveness`` switch on. A ``Scheduler``
    defers too under pipeline parallelism; the plugin's tests drive no such engine, so it
    keeps vLLM's rule there.
    """
    return outputs_arrive_late(scheduler) and frees_deferred(scheduler) and keeps_async_loads_live(scheduler)


def keeps_async_loads_live(scheduler: Any) -> bool:
    """Whether the plugin's ``async_load_liveness`` switch is on for ``scheduler`` (on where it has no plugin config)."""
    config = getattr(scheduler, "hybrid_kv_config", None)
    return config is None or config.async_load_liveness


def reserving_scheduler_of(kv_cache_manager: Any) -> Any:
    """The scheduler whose admissions reserve the running prefills, if ``kv_cache_manager`` is its."""
    ref = _RESERVING_SCHEDULERS.get(kv_cache_manager)
    return None if ref is None else ref()


def manager_of_async_scheduler(manager: Any) -> bool:
    """Whether ``manager`` belongs to an ``AsyncScheduler`` (see :func:`note_scheduler`)."""
    return manager in _ASYNC_SCHEDULERS_MANAGERS
