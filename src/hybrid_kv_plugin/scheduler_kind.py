"""What kind of vLLM scheduler an engine runs, for rules that only one kind needs."""

from __future__ import annotations

import weakref
from typing import Any

# The KV-cache managers (GPU side) of every AsyncScheduler built with the plugin: per-group code
# asks here rather than getting an attribute (0.26-0.29 managers keep theirs inline).
_ASYNC_SCHEDULERS_MANAGERS: weakref.WeakSet[Any] = weakref.WeakSet()


def outputs_arrive_late(scheduler: Any) -> bool:
    """Whether ``scheduler`` is vLLM's ``AsyncScheduler``: only it gives requests output placeholders."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    return isinstance(scheduler, AsyncScheduler)


def note_scheduler(scheduler: Any) -> None:
    """Remember ``scheduler``'s KV-cache managers if it is an ``AsyncScheduler`` (at the end of its constructor)."""
    if outputs_arrive_late(scheduler):
        _ASYNC_SCHEDULERS_MANAGERS.update(scheduler.kv_cache_manager.coordinator.single_type_managers)


def manager_of_async_scheduler(manager: Any) -> bool:
    """Whether ``manager`` belongs to an ``AsyncScheduler`` (see :func:`note_scheduler`)."""
    return manager in _ASYNC_SCHEDULERS_MANAGERS
