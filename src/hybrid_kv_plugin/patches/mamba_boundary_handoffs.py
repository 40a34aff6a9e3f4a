"""Patch ``MambaManager`` (four methods): record the boundary hand-offs vLLM 0.29 publishes.

Why: in ``align`` mode the Mamba manager nulls interior states and moves the
prompt-tail state of a producer request into a copy-on-write block, so nothing
outside it can find the states at hash boundaries by walking the block table.
vLLM 0.29 records each such state as ``(request, group, block, boundary tokens)``
and the scheduler hands them to the KV connector; 0.26-0.28 record none (0.27 and
0.28 offer only the prompt-tail copy, as ``SchedulerOutput.partial_tail_offloads``,
which SimpleCPU ignores). Without them the plugin's fine-grained SimpleCPU
scheduler (:mod:`hybrid_kv_plugin.offload.fine_grained_scheduler`) has no Mamba state to store
and a hybrid CPU hit reconciles to the last whole block, or to 0 (stock 0.28).

What it changes (``align`` groups only; other modes call the stock methods):

* ``cache_blocks``: after the stock call, every block it newly cached (not null,
  hashed) is recorded with ``(index + 1) * block_size`` tokens; a partial-tail
  state the call registered makes the request a producer of that boundary;
* ``allocate_new_blocks``: when the stock call moves a producer's boundary state
  into its copy-on-write block (a running request), that block is recorded with
  the boundary's token count;
* ``pop_blocks_for_free``: a freed request's unpublished records are dropped (its
  blocks go back to the pool now, another request may already hold them);
* ``new_step_starts``: records older than one scheduling pass are dropped, so they
  cannot accumulate when no connector drains them.

The records live beside each manager, in a weak table (:func:`take_handoffs` drains them); the patch
``boundary_handoff_publish`` puts them on the scheduler output. The stock
behaviour of every method is unchanged.

Upstream: vLLM 0.29.0 (``MambaManager._pending_boundary_state_offloads``,
``KVCacheManager.take_boundary_state_offloads``), the prerequisite of PR #54736.
Installed on 0.26.0-0.28.x only; first version where it is removed: 0.29.0.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.patching import Fingerprint, Installs, PatchSpec, ReadsFingerprint

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

OWNER = "vllm.v1.core.single_type_kv_cache_manager:MambaManager"
# Per manager, beside it rather than as attributes: an attribute added after construction
# can move all of a manager's attributes off CPython's fast path (see inert_patches.py).
_HANDOFFS: weakref.WeakKeyDictionary[Any, _ManagerHandoffs] = weakref.WeakKeyDictionary()
# Together with ``boundary_handoff_publish``: wherever the plugin adds the hand-off channel.
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "fine_grained_cpu_hits"
INSTALLS = Installs(when=lambda adapter: adapter.boundary_handoff_patch_needed, since="0.26.0", removed_in="0.29.0")

# One hand-off: (request id, KV-cache group id, block, boundary tokens), as vLLM 0.29 records it.
Handoff = tuple[str, int, Any, int]


def specs(adapter: VllmAdapter) -> list[PatchSpec]:
    """The four targets of this patch, installed together (with every other patch, or none)."""
    common = dict(
        why="record the Mamba align boundary states SimpleCPU must offload (vLLM 0.29 publishes them)",
        upstream="vLLM 0.29.0 boundary_state_offloads (prerequisite of PR #54736)",
    )
    return [
        PatchSpec(
            name="mamba_boundary_handoffs.cache_blocks",
            target=f"{OWNER}.cache_blocks",
            # The stock method must still cache whole blocks through num_cached_block and
            # register the prompt-tail partial state itself.
            fingerprint=ReadsFingerprint(
                params=("self", "request", "num_tokens"),
                owner_attrs=("_cache_partial_tail_block",),
                self_reads=frozenset({"_cache_partial_tail_block", "mamba_cache_mode", "num_cached_block", "req_to_blocks"}),
                at_least=True,
            ),
            build=_wrap_cache_blocks,
            **common,
        ),
        PatchSpec(
            name="mamba_boundary_handoffs.allocate_new_blocks",
            target=f"{OWNER}.allocate_new_blocks",
            # The copy-on-write move of a running request's partial state, as 0.26-0.29 do it.
            fingerprint=ReadsFingerprint(
                params=("self", "request_id", "num_tokens"),
                self_reads=frozenset({"_allocated_block_reqs", "_partial_hit_reqs", "_pending_cow_copies"}),
                at_least=True,
            ),
            build=_wrap_allocate_new_blocks,
            **common,
        ),
        PatchSpec(
            name="mamba_boundary_handoffs.pop_blocks_for_free",
            target=f"{OWNER}.pop_blocks_for_free",
            fingerprint=Fingerprint(params=("self", "request_id"), exact=True),
            build=_wrap_pop_blocks_for_free,
            **common,
        ),
        PatchSpec(
            name="mamba_boundary_handoffs.new_step_starts",
            target=f"{OWNER}.new_step_starts",
            fingerprint=Fingerprint(params=("self",), exact=True),
            build=_wrap_new_step_starts,
            **common,
        ),
    ]


@dataclass
class _ManagerHandoffs:
    """One Mamba manager's hand-offs not yet drained, and its requests that produce a boundary state."""

    records: list[Handoff] = field(default_factory=list)
    producers: dict[str, int] = field(default_factory=dict)  # request id -> boundary tokens


def take_handoffs(manager: Any) -> list[Handoff]:
    """Drain the hand-offs one manager recorded since the last drain (or step start)."""
    state = _HANDOFFS.get(manager)
    if state is None or not state.records:
        return []
    records, state.records = state.records, []
    return records


def _state(manager: Any) -> _ManagerHandoffs:
    state = _HANDOFFS.get(manager)
    if state is None:
        state = _HANDOFFS[manager] = _ManagerHandoffs()
    return state


def _records(manager: Any) -> list[Handoff]:
    return _state(manager).records


def _producers(manager: Any) -> dict[str, int]:
    return _state(manager).producers


def _wrap_cache_blocks(original: Any) -> Any:
    @functools.wraps(original)
    def cache_blocks(self: Any, request: Any, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
        if self.mamba_cache_mode != "align":
            return original(self, request, num_tokens, *args, **kwargs)
        req_id = request.request_id
        cached_before = self.num_cached_block.get(req_id, 0)
        partial_before = self._partial_hit_reqs.get(req_id)
        result = original(self, request, num_tokens, *args, **kwargs)
        cached_after = self.num_cached_block.get(req_id, 0)
        blocks = self.req_to_blocks.get(req_id, ())
        records = _records(self)
        for index in range(cached_before, min(cached_after, len(blocks))):
            block = blocks[index]
            if block.is_null or block.block_hash is None:  # a skipped interior state
                continue
            records.append((req_id, self.kv_cache_group_id, block, (index + 1) * self.block_size))
        partial_after = self._partial_hit_reqs.get(req_id)
        if partial_after is not None and partial_after is not partial_before:
            # This call registered the request's own partial state at num_tokens; the
            # next step's forward overwrites it in place, so the copy-on-write block
            # that preserves it is what a connector must store.
            _producers(self)[req_id] = num_tokens
        return result

    return cache_blocks


def _wrap_allocate_new_blocks(original: Any) -> Any:
    @functools.wraps(original)
    def allocate_new_blocks(self: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        boundary = _producers(self).get(request_id) if self.mamba_cache_mode == "align" else None
        if boundary is None:
            return original(self, request_id, *args, **kwargs)
        partial = self._partial_hit_reqs.get(request_id)
        running = request_id in self._allocated_block_reqs
        copies_before = len(self._pending_cow_copies)
        result = original(self, request_id, *args, **kwargs)
        moved = partial is not None and running and request_id not in self._partial_hit_reqs
        if moved and len(self._pending_cow_copies) > copies_before:
            source, cow_block = self._pending_cow_copies[-1]
            if source is partial[1]:
                del _producers(self)[request_id]
                _records(self).append((request_id, self.kv_cache_group_id, cow_block, boundary))
        return result

    return allocate_new_blocks


def _wrap_pop_blocks_for_free(original: Any) -> Any:
    @functools.wraps(original)
    def pop_blocks_for_free(self: Any, request_id: str) -> Any:
        state = _HANDOFFS.get(self) if self.mamba_cache_mode == "align" else None
        if state is not None:
            state.producers.pop(request_id, None)
            if state.records:
                state.records = [entry for entry in state.records if entry[0] != request_id]
        return original(self, request_id)

    return pop_blocks_for_free


def _wrap_new_step_starts(original: Any) -> Any:
    @functools.wraps(original)
    def new_step_starts(self: Any) -> Any:
        state = _HANDOFFS.get(self)
        if state is not None:
            state.records = []
        return original(self)

    return new_step_starts
