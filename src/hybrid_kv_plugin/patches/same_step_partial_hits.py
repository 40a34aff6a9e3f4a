"""Patch the block pool and the KV-cache manager: a full-attention partial hit waits a step when its block is written by this step's forward pass.

Why: a prefix-cache key is registered when a chunk is *scheduled*, before the
forward pass writes it: vLLM keys the prompt tail of a chunk as it allocates it,
and ``mamba_divergence_checkpoint`` keys every prefix-match unit the same way. A
full-block hit on such a block is safe (the hitting request reads it in the same
forward pass, after every token's KV of the layer is written), but a hit that ends
*inside* the block is served by a copy-on-write copy into a private block, and the
worker runs the step's copies before its forward pass: the copy reads KV that is
not there yet and the request attends to zeroed KV for the hit tokens. Found by the
byte-moving simulator (soak variant ``plugin-divergence-fa64``, seed 2: on 0.29 and
0.33 a request admitted in the step that computes tokens 64..112 of a shared
prefix hit 80 tokens and read a zeroed block); stock vLLM has the same hole for its
own prompt-tail key (two requests with one prompt admitted in consecutive
scheduling passes of one step). The Mamba manager already defers a hit on a state
cached in the same step (``cached_blocks_this_step``); the attention managers do not.

What it changes (three attributes, installed together):

* ``BlockPool.cache_partial_block``: after the wheel's method, a key registered for
  a position the requesting request has not computed yet marks its block as
  written from ``max(computed tokens, block start)`` by this step's forward pass;
* ``KVCacheManager.allocate_slots``: a request whose local hit ends inside such a
  block of a full-attention group, past that position, is not allocated this step
  (the answer the scheduler gets when blocks run short), so it is admitted a step
  later, when the copy reads written KV; every other call runs the wheel's method;
* ``KVCacheManager.new_step_starts``: forgets the marks (the scheduler calls it
  before each step's allocations).

A deferred request waits at most one step (its block is written by then). Sliding
window and chunked local attention managers are subclasses of the full-attention
one and get the same rule. The check sits in ``allocate_slots`` (about two calls a
step) rather than in the managers' block count (about thirteen).

Upstream: none yet (vLLM 0.33 registers the prompt-tail key at scheduling time and
copies partial hits before the forward pass); installed on every wheel 0.26.0-0.33.x
(removed in: none yet).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.patching import Fingerprint, Installs, PatchSpec

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

POOL = "vllm.v1.core.block_pool:BlockPool"
KV_CACHE_MANAGER = "vllm.v1.core.kv_cache_manager:KVCacheManager"
# Every supported wheel keys partial attention blocks at scheduling time and copies partial hits.
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "vllm_fix"
INSTALLS = Installs(when=lambda adapter: True, since="0.26.0")

# Per block pool (by id): block id -> the first position this step's forward pass writes in it.
# Kept off the pool object (a new instance attribute would take its attributes off CPython's
# inline storage); emptied at the start of every step, so an id a later pool reuses starts clean.
_WRITTEN_FROM: dict[int, dict[int, int]] = {}


def specs(adapter: VllmAdapter) -> list[PatchSpec]:
    """The three targets of this patch, installed together (with every other patch, or none)."""
    common = dict(
        why="a partial hit's copy-on-write copy runs before the forward pass that writes its source block",
        upstream="none yet",
    )
    return [
        PatchSpec(
            name="same_step_partial_hits.mark",
            target=f"{POOL}.cache_partial_block",
            fingerprint=Fingerprint(params=("self", "request", "block", "num_tokens", "kv_cache_group_id", "block_size")),
            build=_wrap_mark,
            **common,
        ),
        PatchSpec(
            name="same_step_partial_hits.defer",
            target=f"{KV_CACHE_MANAGER}.allocate_slots",
            fingerprint=Fingerprint(
                params=("self", "request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks"),
                owner_attrs=("new_step_starts",),
            ),
            build=_wrap_defer,
            **common,
        ),
        PatchSpec(
            name="same_step_partial_hits.forget",
            target=f"{KV_CACHE_MANAGER}.new_step_starts",
            fingerprint=Fingerprint(params=("self",), exact=True),
            build=_wrap_forget,
            **common,
        ),
    ]


def unwritten_hit(block: Any, hit_tokens: int, block_size: int, pool: Any) -> bool:
    """Whether a hit of ``hit_tokens`` ending inside ``block`` reads positions this step's forward pass writes."""
    written_from = _WRITTEN_FROM.get(id(pool))
    if not written_from or not hit_tokens % block_size:
        return False
    start = written_from.get(block.block_id)
    return start is not None and hit_tokens > start


def _wrap_mark(original: Any) -> Any:
    @functools.wraps(original)
    def cache_partial_block(
        self: Any, request: Any, block: Any, num_tokens: int, kv_cache_group_id: int, block_size: int,
        *args: Any, **kwargs: Any,
    ) -> Any:
        key = original(self, request, block, num_tokens, kv_cache_group_id, block_size, *args, **kwargs)
        computed = request.num_computed_tokens
        if key is not None and num_tokens > computed:
            start = max(computed, num_tokens - num_tokens % block_size)
            marks = _WRITTEN_FROM.setdefault(id(self), {})
            if marks.get(block.block_id, start) >= start:
                marks[block.block_id] = start
        return key

    return cache_partial_block


def unwritten_local_hit(kv_cache_manager: Any, hit_tokens: int, new_computed_blocks: Any, full_attention: type) -> bool:
    """Whether a local hit of ``hit_tokens`` ends, in a ``full_attention`` group, inside a block this step writes there."""
    pool = kv_cache_manager.block_pool
    for manager, blocks in zip(kv_cache_manager.coordinator.single_type_managers, new_computed_blocks.blocks):
        if blocks and isinstance(manager, full_attention) and unwritten_hit(blocks[-1], hit_tokens, manager.block_size, pool):
            return True
    return False


def _wrap_defer(original: Any) -> Any:
    # Resolved once at install, not on each allocation (the patch package imports no vLLM at discovery).
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    @functools.wraps(original)
    def allocate_slots(
        self: Any,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        # Most calls find no block marked this step (one dict test) or carry no new hit.
        if (
            _WRITTEN_FROM
            and new_computed_blocks is not None
            and unwritten_local_hit(
                self, request.num_computed_tokens + num_new_computed_tokens, new_computed_blocks, FullAttentionManager
            )
        ):
            return None  # not this step: the scheduler tries again next step
        return original(self, request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, *args, **kwargs)

    return allocate_slots


def _wrap_forget(original: Any) -> Any:
    @functools.wraps(original)
    def new_step_starts(self: Any) -> None:
        if _WRITTEN_FROM:
            _WRITTEN_FROM.pop(id(self.block_pool), None)
        return original(self)

    return new_step_starts
