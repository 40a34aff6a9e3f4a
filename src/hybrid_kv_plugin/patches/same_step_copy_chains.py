"""Patch ``KVCacheManager.take_kv_cache_block_copies``: a copy whose source is filled by another copy of the same step reads that copy's source.

Why: a partial prefix-cache hit is served by a copy-on-write copy of the cached
block into a private one, queued for the worker to run before the step's forward
pass. The worker zeroes the step's new blocks and then runs all queued copies as
one batched gather-scatter (``blocks[dst] = blocks[src]`` in
``copy_kv_cache_blocks_inplace``), so every copy reads its source as it was
before *any* copy of the step ran. When two requests with a common prefix are
admitted in the same step, the first one's private copy (just allocated, zeroed,
filled by its own queued copy, and already cached under its full-block hash) can
be the second one's hit: the second copy then reads zeros - the second request
attends to zeroed KV for the hit tokens (found by the byte-moving simulator:
attention 32 over a 16-token unit, two requests sharing 80 tokens, stock vLLM
0.30-0.33 and the plugin's 0.29 backport alike).

What it changes: in the list the scheduler hands the worker, a copy whose source
block is the destination of an earlier copy of the same list reads that earlier
copy's (resolved) source instead - the bytes the scheduler meant, since no
forward pass runs between the two copies. The retained blocks are unchanged (the
earlier source stays retained until the copies have run). No copy chains: the
list is returned unchanged. Scheduler-side only; relies on the worker running a
step's copies after its zeroing and before its forward pass (``_update_states``
of the GPU model runner, 0.26-0.33).

Upstream: none yet (vLLM 0.33 runs chained copies as one batch); installed on
every wheel 0.26.0-0.33.x (removed in: none yet).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.patching import Fingerprint, Installs, PatchSpec

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = "vllm.v1.core.kv_cache_manager:KVCacheManager.take_kv_cache_block_copies"
# Every supported wheel queues copy-on-write copies through this method.
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "vllm_fix"
INSTALLS = Installs(when=lambda adapter: True, since="0.26.0")


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="same_step_copy_chains",
        target=TARGET,
        fingerprint=Fingerprint(params=("self",), exact=True),
        build=_wrap,
        why="a step's copies run as one batch: a copy must not read a block another copy of the step fills",
        upstream="none yet",
    )


def resolve_copy_chains(copies: list[Any]) -> list[Any]:
    """``copies`` with each source that an earlier copy fills replaced by that copy's source."""
    filled_from: dict[int, int] = {}
    resolved = []
    for copy in copies:
        src = filled_from.get(copy.src_block_id, copy.src_block_id)
        resolved.append(copy if src == copy.src_block_id else copy._replace(src_block_id=src))
        filled_from[copy.dst_block_id] = src
    return resolved


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def take_kv_cache_block_copies(self: Any) -> Any:
        taken = original(self)  # (copies, retained)
        if len(taken[0]) > 1:
            return resolve_copy_chains(taken[0]), taken[1]
        return taken  # the usual step: the wheel's own pair, not unpacked and rebuilt

    return take_kv_cache_block_copies
