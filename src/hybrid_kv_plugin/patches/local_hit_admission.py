"""Patch the block pool and the KV-cache manager: two rules for admitting a request with a local prefix hit.

**A partial hit on a block this step writes waits a step.**
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
prefix hit 80 tokens and read a zeroed block; ``tests/test_same_step_partial_hit.py``
builds the case); stock vLLM has the same hole for its
own prompt-tail key (two requests with one prompt admitted in consecutive
scheduling passes of one step). The Mamba manager already defers a hit on a state
cached in the same step (``cached_blocks_this_step``); the attention managers do not.

**A hit that cannot fit even in an empty pool is dropped.**
Why: vLLM admits a waiting request only if its whole sequence fits
(``scheduler_reserve_full_isl``, on by default), counted *with* its local hit, and
a hit ending inside a Mamba block costs that group more blocks than no hit (the
copy-on-write source, the private copy and the prefill checkpoint). Near
``max_model_len`` on a small pool a request then fits without its hit and never
with it: the scheduler finds the same hit every step, the request never fits, and
under FCFS every request behind it waits too - the engine hangs with nothing
running (``tests/test_hit_never_fits.py``: a 383-token request extending a 49-token
one, 64-token blocks, 10-block pool, on every wheel). Found by the randomized soak
(``plugin`` with 64-token attention blocks, seed 39, 0.32.0 and 0.33.0).

What it changes (four attributes, installed together):

* ``BlockPool.cache_partial_block``: after the wheel's method, a key registered for
  a position the requesting request has not computed yet marks its block as
  written from ``max(computed tokens, block start)`` by this step's forward pass;
* ``BlockPool.cache_full_blocks``: likewise for the full blocks a chunk keys as it is
  scheduled, on engines where a hit can end inside one, with attention blocks coarser
  than the unit (``scheduler_kind.HIT_INSIDE_FULL_BLOCKS``; other engines mark nothing):
  EAGLE drops one prefix-match unit off a full-block hit (found by the soak's
  ``plugin-junction`` with 32-token attention blocks, 0.26-0.33: a request admitted in
  the step that computes a shared prefix's block 128..160 hit 144 and read zeros); and
  a hybrid model's hit ends where every group has one, so a Mamba state at a unit
  boundary cuts a whole-block attention hit inside the block (no option needed; found
  by a 50,000-step soak, ``plugin-auto-ends-fa32`` seed 600 on 0.31, step 43,417:
  a request hit 96 in the block 64..96 another one computes that step, and the prompt-end
  state at 80 of an earlier request cut the hit to 80: its copy read zeros;
  ``tests/test_same_step_full_block_hit.py``, 0.26-0.33 but 0.27.1, whose scheduler
  admits the second request a step later by itself);
* ``KVCacheManager.allocate_slots``: a request whose local hit ends inside such a
  block of a full-attention group, past that position, is not allocated this step
  (the answer the scheduler gets when blocks run short), so it is admitted a step
  later, when the copy reads written KV. When the wheel's method refuses a request
  that brought a local hit while every block of the pool is free (nothing holds
  one, so no later step has more room), the request stops reading the prefix cache
  (``request.skip_reading_prefix_cache``, vLLM's own switch for requests that must
  recompute): it is admitted on the next step and computed in full, its blocks
  still cached for others; a warning says so once. Only for that admission: once
  allocated, the request reads the cache again (vLLM's own setting back), so a
  later preemption resumes from what it computed (kept for good, a request that
  0.29's ``AsyncScheduler`` preempts at its first decode recomputed from token 0
  every time: soak ``plugin`` attention 64, seed 8, on 0.29). 0.26's connector-path
  lookup does not read that switch: ``connector_hit_reconcile`` asks :func:`reads_no_cache`;
* ``KVCacheManager.new_step_starts``: forgets the marks (the scheduler calls it
  before each step's allocations).

A deferred request waits at most one step (its block is written by then). Sliding
window and chunked local attention managers are subclasses of the full-attention
one and get the same rule. Both checks sit in one ``allocate_slots`` wrapper (about
two calls a step) rather than in the managers' block count (about thirteen) or in
a second wrapper (+29 bytecodes a step on 0.29's bench).

Upstream: none yet for either (vLLM 0.33 registers the prompt-tail key at scheduling
time, copies partial hits before the forward pass, and counts a partial Mamba hit's
extra blocks at admission); installed on every wheel 0.26.0-0.33.x (removed in: none yet).
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin._log import log_once
from hybrid_kv_plugin.patching import Fingerprint, Installs, PatchSpec
from hybrid_kv_plugin.scheduler_kind import HIT_INSIDE_FULL_BLOCKS, groups_hit_inside_full_blocks

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

POOL = "vllm.v1.core.block_pool:BlockPool"
KV_CACHE_MANAGER = "vllm.v1.core.kv_cache_manager:KVCacheManager"
# Every supported wheel keys partial attention blocks at scheduling time, copies partial hits and
# admits a waiting request by its whole sequence, hit included.
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "vllm_fix"
INSTALLS = Installs(when=lambda adapter: True, since="0.26.0")

# Per block pool (by id): block id -> the first position this step's forward pass writes in it.
# Kept off the pool object (a new instance attribute would take its attributes off CPython's
# inline storage); emptied at the start of every step, so an id a later pool reuses starts clean.
_WRITTEN_FROM: dict[int, dict[int, int]] = {}


def specs(adapter: VllmAdapter) -> list[PatchSpec]:
    """The four targets of this patch, installed together (with every other patch, or none)."""
    common = dict(
        why="a partial hit's copy-on-write copy runs before the forward pass that writes its source block, "
        "and a hit that makes a request too large for the whole pool is refused forever",
        upstream="none yet",
    )
    return [
        PatchSpec(
            name="local_hit_admission.mark",
            target=f"{POOL}.cache_partial_block",
            fingerprint=Fingerprint(params=("self", "request", "block", "num_tokens", "kv_cache_group_id", "block_size")),
            build=_wrap_mark,
            **common,
        ),
        PatchSpec(
            name="local_hit_admission.mark_full",
            target=f"{POOL}.cache_full_blocks",
            fingerprint=Fingerprint(
                params=("self", "request", "blocks", "num_cached_blocks", "num_full_blocks", "block_size", "kv_cache_group_id")
            ),
            build=_wrap_mark_full,
            # Bound past on the GPU pool of every engine whose hits cannot end inside a full block
            # (no EAGLE-family drafter, or attention blocks no coarser than the unit): a call per
            # group per request per step that would only pass through.
            inert_for=lambda _, scheduler: not groups_hit_inside_full_blocks(scheduler),
            **common,
        ),
        PatchSpec(
            name="local_hit_admission.admit",
            target=f"{KV_CACHE_MANAGER}.allocate_slots",
            fingerprint=Fingerprint(
                params=("self", "request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks"),
                owner_attrs=("new_step_starts",),
            ),
            build=_wrap_admit,
            **common,
        ),
        PatchSpec(
            name="local_hit_admission.forget",
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
        self: Any, request: Any, block: Any, num_tokens: int, kv_cache_group_id: int, block_size: int, **kwargs: Any
    ) -> Any:
        # Every wheel passes the parameters after ``block_size`` (0.30+: one) by keyword.
        key = original(self, request, block, num_tokens, kv_cache_group_id, block_size, **kwargs)
        computed = request.num_computed_tokens
        if key is not None and num_tokens > computed:
            # mark_written inlined: about one call in two steps, on every engine.
            start = max(computed, num_tokens - num_tokens % block_size)
            marks = _WRITTEN_FROM.setdefault(id(self), {})
            if marks.get(block.block_id, start) >= start:
                marks[block.block_id] = start
        return key

    return cache_partial_block


def _wrap_mark_full(original: Any) -> Any:
    @functools.wraps(original)
    def cache_full_blocks(
        self: Any, request: Any, blocks: Any, num_cached_blocks: int, num_full_blocks: int, block_size: int,
        kv_cache_group_id: int, *args: Any, **kwargs: Any,
    ) -> Any:
        original(self, request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id, *args, **kwargs)
        if HIT_INSIDE_FULL_BLOCKS:  # an engine whose hits can end inside full blocks exists: is it this pool?
            entry = HIT_INSIDE_FULL_BLOCKS.get(id(self))
            computed = request.num_computed_tokens
            # Blocks keyed now that this step's forward pass still writes (all but a hit's or a replay's).
            if (
                entry is not None and entry[0]() is self and kv_cache_group_id in entry[1]
                and num_full_blocks * block_size > computed
            ):
                for index in range(max(num_cached_blocks, computed // block_size), num_full_blocks):
                    mark_written(self, blocks[index].block_id, max(computed, index * block_size))

    return cache_full_blocks


def mark_written(pool: Any, block_id: int, start: int) -> None:
    """Mark block ``block_id`` of ``pool`` as written by this step's forward pass from position ``start``
    (a block marked twice in a step keeps the earlier start; ``cache_partial_block`` inlines the same rule)."""
    marks = _WRITTEN_FROM.setdefault(id(pool), {})
    if marks.get(block_id, start) >= start:
        marks[block_id] = start


def unwritten_local_hit(kv_cache_manager: Any, hit_tokens: int, new_computed_blocks: Any, full_attention: type) -> bool:
    """Whether a local hit of ``hit_tokens`` ends, in a ``full_attention`` group, inside a block this step writes there."""
    pool = kv_cache_manager.block_pool
    for manager, blocks in zip(kv_cache_manager.coordinator.single_type_managers, new_computed_blocks.blocks):
        if blocks and isinstance(manager, full_attention) and unwritten_hit(blocks[-1], hit_tokens, manager.block_size, pool):
            return True
    return False


def pool_is_empty(block_pool: Any) -> bool:
    """No request holds a block: every block but the null one is free (cached ones included)."""
    return block_pool.get_num_free_blocks() >= block_pool.num_gpu_blocks - 1


# Requests admitted without their hit: they read the prefix cache again once allocated.
_READING_DROPPED: weakref.WeakSet[Any] = weakref.WeakSet()


def read_no_cache(request: Any) -> None:
    """``request``'s next admission is computed without prefix-cache hits (its blocks are still cached)."""
    request.skip_reading_prefix_cache = True
    _READING_DROPPED.add(request)
    log_once(
        logging.WARNING,
        "hybrid-kv-plugin: a request's prefix-cache hit needs more KV blocks than the whole pool holds; "
        "such requests are recomputed without the cache (raise the KV cache size or lower max_model_len)",
    )


def reads_no_cache(block_hashes: Any) -> bool:
    """Whether the request owning ``block_hashes`` is admitted without its hit this time.

    For 0.26's per-group lookup (``connector_hit_reconcile``), which gets a request's
    hashes but not the request, and does not read ``skip_reading_prefix_cache``.
    """
    return bool(_READING_DROPPED) and any(request.block_hashes is block_hashes for request in _READING_DROPPED)


def _wrap_admit(original: Any) -> Any:
    # Resolved once at install, not on each allocation (the patch package imports no vLLM at discovery).
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    @functools.wraps(original)
    def allocate_slots(
        self: Any,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        **kwargs: Any,  # every wheel passes the parameters after new_computed_blocks by keyword
    ) -> Any:
        # Most calls find no block marked this step (one dict test) or carry no new hit.
        if (
            _WRITTEN_FROM
            and num_new_computed_tokens  # a new local hit (none: no copy to read early)
            and new_computed_blocks is not None
            and unwritten_local_hit(
                self, request.num_computed_tokens + num_new_computed_tokens, new_computed_blocks, FullAttentionManager
            )
        ):
            return None  # not this step: the scheduler tries again next step
        blocks = original(self, request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, **kwargs)
        if blocks is None:
            if num_new_computed_tokens and pool_is_empty(self.block_pool):
                read_no_cache(request)
        elif request.skip_reading_prefix_cache and request in _READING_DROPPED:  # one attribute test for most
            _READING_DROPPED.discard(request)
            request.skip_reading_prefix_cache = request.get_skip_reading_prefix_cache()
        return blocks

    return allocate_slots


def _wrap_forget(original: Any) -> Any:
    @functools.wraps(original)
    def new_step_starts(self: Any) -> None:
        if _WRITTEN_FROM:
            _WRITTEN_FROM.pop(id(self.block_pool), None)
        return original(self)

    return new_step_starts
