"""Patch ``Scheduler._preempt_request``: a preempted request's prompt is keyed at every unit again when it recomputes.

Why: ``divergence_attention_keys`` keys a request's attention blocks at every
prefix-match-unit boundary as its prompt is computed, and then stops looking (one
comparison per request per step: :mod:`hybrid_kv_plugin.divergence.attention`). A
preemption frees those blocks; when the request recomputes into new ones (its
blocks were evicted, or ``reset_prefix_cache(reset_running_requests=True)`` dropped
them, as RL weight updates do) the new blocks carried block-end keys only. A later
request diverging inside one of them then saw no divergence (Qwen3-Next geometry,
r0 preempted after its answer filled the block holding its prompt's end: r1 diverging
at 800 hit 0 and found no junction inside the block, r2 resumed at 544 instead of 800).

What it changes: after the wrapped method, a request that was keyed forgets where
keying stopped, so the next keying call re-reads its progress (the preemption
count tells it the request recomputes) and keys the new blocks. Runs once per
preemption; a request never keyed (option off) gets no attribute.

Upstream: none yet (vLLM keys one attention prompt-tail position); installed on
0.29.0-0.33.x with ``divergence_attention_keys``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.divergence.attention import forget_keying_progress
from hybrid_kv_plugin.patching import Fingerprint, Installs, PatchSpec

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = "vllm.v1.core.sched.scheduler:Scheduler._preempt_request"
PARAMS = ("self", "request", "timestamp", "drop_stale_output")
INSTALLS = Installs(when=lambda adapter: adapter.divergence_checkpoint_supported, since="0.29.0")
FEATURE = "mamba_divergence_checkpoint"


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="divergence_keys_after_preemption",
        target=TARGET,
        fingerprint=Fingerprint(params=PARAMS, exact=True),
        build=_wrap,
        why="a preempted request recomputes into new attention blocks, which its unit keys must reach again",
        upstream="none yet (vLLM keys one attention prompt-tail position)",
    )


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def _preempt_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> None:
        original(self, request, *args, **kwargs)
        forget_keying_progress(request)

    return _preempt_request
