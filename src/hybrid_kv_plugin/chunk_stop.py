"""Cutting a prefill chunk short where a feature wants a Mamba state kept.

In Mamba ``align`` mode the model runner writes a request's state only where a
scheduled chunk ends, so every feature that keeps a state at a new position
(the shared-prefix junction, the prompt tail) must end a chunk there. They all do
it the same way: let the wheel's ``Scheduler._mamba_block_aligned_split`` decide
the chunk, then cut it at the feature's earliest position strictly inside it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.patching import ReadsFingerprint

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

SPLIT_TARGET = "vllm.v1.core.sched.scheduler:Scheduler._mamba_block_aligned_split"
SPLIT_PARAMS = ("self", "request", "num_new_tokens", "num_new_local_computed_tokens", "num_external_computed_tokens")


def stock_split_fingerprint(adapter: VllmAdapter) -> ReadsFingerprint:
    """The wheel's split as the plugin was written for it: the attributes it reads differ per
    wheel, and any other set means its stops changed, so a stop added on top could contradict them."""
    return ReadsFingerprint(params=SPLIT_PARAMS, exact=True, self_reads=adapter.mamba_split_reads)


# (scheduler, request, start, end) -> the position to end the chunk at, strictly inside
# (start, end), or None to keep the wheel's chunk.
StopAt = Callable[[Any, Any, int, int], "int | None"]


def wrap_split(original: Any, stop_at: StopAt) -> Any:
    """The wheel's split, cut at ``stop_at``'s position; the wheel's stops are all kept."""

    @functools.wraps(original)
    def _mamba_block_aligned_split(
        self: Any,
        request: Any,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        scheduled = original(self, request, num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens)
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        stop = stop_at(self, request, start, start + scheduled)
        return scheduled if stop is None else stop - start

    return _mamba_block_aligned_split
