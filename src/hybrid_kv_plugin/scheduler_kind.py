"""What kind of vLLM scheduler an engine runs, for rules that only one kind needs."""

from __future__ import annotations

from typing import Any


def outputs_arrive_late(scheduler: Any) -> bool:
    """Whether ``scheduler`` is vLLM's ``AsyncScheduler``: only it gives requests output placeholders."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    return isinstance(scheduler, AsyncScheduler)
