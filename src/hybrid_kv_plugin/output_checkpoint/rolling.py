"""What a decode step ending on a prefix-match-unit boundary does to its request's kept answer states.

The state after ``p`` tokens sits in the running state block only until the next
forward pass; :func:`~hybrid_kv_plugin.mamba_partial_state.keep_partial_state`
keeps it the way the wheel keeps its own prompt tail (partial key, copy-on-write
into a fresh block at the next allocation, boundary hand-off to a connector).
Each newer boundary makes the older kept states of the same request stale (a
later turn's hit lands on the newest one), so they leave the prefix cache: a
running request holds at most :attr:`OutputCheckpoint.max_states` of them, and a
finished one leaves its last in the GPU prefix cache (evictable).

Under vLLM's ``AsyncScheduler`` (what a GPU ``vllm serve`` runs) the token that
completes a boundary's hash is sampled by the step before, whose output arrives
only after the next step is scheduled: the boundary is cached while allocating the
step whose forward overwrites the running state block, after the wheel's own
copy-on-write of that allocation was queued. :func:`late_boundary` tells the two
cases apart; the state is then copied into a fresh block in that same step
(:func:`_copy_out_now`), so the kept state is the one after exactly the tokens its
key names, as under ``Scheduler``.

The records live on the request, per KV-cache group, so they end with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybrid_kv_plugin.attention_partial_block import ANSWER_STATES_ATTR
from hybrid_kv_plugin.output_checkpoint.binding import OutputCheckpoint
from hybrid_kv_plugin.mamba_partial_state import cache_partial_key, keep_partial_state

# Under AsyncScheduler (late_boundary): the step ending at the boundary still runs or its output
# is still due, and the step being scheduled overwrites the state; or nothing is scheduled past it.
IN_FLIGHT = "in_flight"
IDLE = "idle"


@dataclass
class KeptState:
    """``holder``: the running block the state is in until the copy-on-write;
    ``copy``: the block the copy-on-write filled (where the prefix-cache key then lives)."""

    position: int
    key: Any
    holder: Any
    copy: Any = None


def kept_states(request: Any, group_id: int) -> list[KeptState]:
    groups = getattr(request, ANSWER_STATES_ATTR, None)
    if groups is None:  # setattr, not request.__dict__: see divergence.attention.REQUEST_ATTR
        groups = {}
        setattr(request, ANSWER_STATES_ATTR, groups)
    return groups.setdefault(group_id, [])


def note_copies(manager: Any, request: Any) -> None:
    """Record where the copy-on-write put each kept state (run on every decode step's caching).

    The copy is queued by the allocation that precedes the same step's caching, and
    drained when that step's schedule ends, so each step looks once.
    """
    states = getattr(request, ANSWER_STATES_ATTR, {}).get(manager.kv_cache_group_id)
    for state in states or ():
        if state.copy is None:
            for source, copy in manager._pending_cow_copies:
                if source is state.holder:
                    state.copy = copy


def at_output_boundary(manager: Any, request: Any, num_tokens: int, checkpoint: OutputCheckpoint,
                       producer_holds_block: bool) -> Any:
    """``num_tokens`` (> prompt, a unit multiple) ends the step being cached: keep its state, drop stale ones."""
    states = kept_states(request, manager.kv_cache_group_id)
    if num_tokens % manager.block_size == 0 and not _block_end_kept(manager, request, num_tokens):
        # A Mamba block end that sparse retention does not keep (0.29 under retention 0):
        # the older state is still the newest one there is.
        return None
    floor = checkpoint.keep_from(num_tokens)
    for stale in [s for s in states if s.position < floor]:
        _drop(manager, request, stale)
        states.remove(stale)
    # Mamba block ends are full-block entries (cached by the wheel, or for the option by
    # prompt_tail_retention).
    if num_tokens % manager.block_size == 0:
        return None
    blocks = manager.req_to_blocks[request.request_id]
    index = num_tokens // manager.block_size
    holder = blocks[index] if index < len(blocks) else None
    late = None
    if request.num_computed_tokens >= num_tokens:
        late = late_boundary(request, num_tokens, checkpoint)
        if late is None or holder is None or holder.is_null:
            # A step that does not compute up to num_tokens (a resumed request's cached part)
            # writes no state there; or the forward that overwrites it is already scheduled.
            return None
        if late == IN_FLIGHT:
            kept = _copy_out_now(manager, request, num_tokens, holder)
            if kept is None:
                return None
            states.append(kept)
            return kept.key
    # Scheduler: cached at schedule time for the step computing up to num_tokens. AsyncScheduler,
    # nothing scheduled past num_tokens: the same, a step late (a request that stops here leaves
    # the state in its freed block, and 0.30+ hand a producer's partial tail over at finish).
    key = keep_partial_state(manager, request, num_tokens, producer_holds_block)
    if key is not None:
        states.append(KeptState(num_tokens, key, holder))
        if late is None and is_last_step(request, num_tokens):
            _hand_off_last_step(manager, request, holder, num_tokens)
    return key


def late_boundary(request: Any, num_tokens: int, checkpoint: OutputCheckpoint) -> str | None:
    """Under ``AsyncScheduler``, where the state after ``num_tokens`` is when that boundary is cached.

    The boundary is cached once its last token is known, a step after the forward that
    computes it was scheduled: when the next step is allocated (that step's forward
    will overwrite the running state block), or when the output arrives. Returns
    :data:`IN_FLIGHT` when the last scheduled step ends at ``num_tokens`` and its output is
    still due (the caller is the next step's allocation), :data:`IDLE` when it ends there
    and nothing more is scheduled, None otherwise (a later step is already scheduled, or
    the request is not decoding: a finished load, a draft).
    """
    if not checkpoint.late_outputs or checkpoint.speculative or request.num_computed_tokens != num_tokens:
        return None
    if request.num_output_placeholders > 0:
        return IN_FLIGHT
    from vllm.v1.request import RequestStatus

    if request.status == RequestStatus.RUNNING or request.is_finished():
        return IDLE
    return None


def _block_end_kept(manager: Any, request: Any, num_tokens: int) -> bool:
    """Whether the full Mamba block ending at ``num_tokens`` is hashed there (run after the full blocks are cached)."""
    blocks = manager.req_to_blocks[request.request_id]
    index = num_tokens // manager.block_size - 1
    return index < len(blocks) and blocks[index].block_hash_num_tokens == num_tokens


def retained_block_end(manager: Any, request: Any, num_tokens: int, checkpoint: OutputCheckpoint,
                       retention_interval: int | None) -> int | None:
    """The answer's Mamba block end sparse retention must also keep for this step, if any.

    Under retention 0 the wheel hashes a full Mamba block only at its replay boundaries
    (the prompt's), so during decode no block end is kept; dense retention (None) keeps
    every one and a positive interval one per segment, left to the wheel.
    """
    if (
        retention_interval != 0
        or num_tokens % manager.block_size
        or request.num_computed_tokens >= num_tokens
        or not checkpoint.keeps(num_tokens, request.num_prompt_tokens)
    ):
        return None
    return num_tokens


def note_block_end(manager: Any, request: Any, num_tokens: int) -> None:
    """Record the block end retained for the option, so a newer boundary drops it like the others."""
    if _block_end_kept(manager, request, num_tokens):
        block = manager.req_to_blocks[request.request_id][num_tokens // manager.block_size - 1]
        kept_states(request, manager.kv_cache_group_id).append(
            KeptState(num_tokens, block.block_hash, block, copy=block)
        )


def is_last_step(request: Any, num_tokens: int) -> bool:
    """Whether the step computing up to ``num_tokens`` samples the request's last token (its length limit).

    Only a step that computes every token the request has samples one: a preempted request
    recomputing its prompt and answer in chunks can reach its last answer token minus one
    with a chunk that ends short of its length, and a later step still allocates for it.
    """
    return num_tokens == request.num_tokens and request.num_output_tokens + 1 >= request.max_tokens


def _hand_off_last_step(manager: Any, request: Any, holder: Any, num_tokens: int) -> None:
    """The request's last step (its length limit): no later allocation copies the state out.

    This step's forward is the last to write ``holder``, and the connector stores a
    hand-off after that forward (as it does for the Mamba block ends the wheel offers
    during decode), pinning the block until the copy is done; so the running block
    itself is handed over, the way the copy-on-write block would have been.
    """
    manager._producer_partial_tail_reqs.pop(request.request_id, None)
    manager._pending_boundary_state_offloads.append((request.request_id, manager.kv_cache_group_id, holder, num_tokens))


def _copy_out_now(manager: Any, request: Any, num_tokens: int, holder: Any) -> KeptState | None:
    """Key the state after ``num_tokens`` on a fresh block and queue its copy from ``holder`` now.

    The allocation of the step being scheduled has already run (the wheel's own
    copy-on-write is queued there), and that step's forward overwrites ``holder``;
    the queued copy runs before it, after the in-flight forward that writes the
    state. As for the wheel's copy-on-write of a running request, both blocks are
    held until the step has run (the scheduler frees the copy's retention) and the
    copy is handed to a connector. No free block: nothing kept (lost reuse only).
    """
    pool = manager.block_pool
    if pool.get_num_free_blocks() < 1:
        return None
    copy = pool.get_new_blocks(1)[0]
    key = cache_partial_key(manager, request, copy, num_tokens)
    if key is None:
        pool.free_blocks([copy])
        return None
    holder.ref_cnt += 1
    manager._pending_cow_copies.append((holder, copy))
    manager._pending_boundary_state_offloads.append((request.request_id, manager.kv_cache_group_id, copy, num_tokens))
    return KeptState(num_tokens, key, holder, copy=copy)


def _drop(manager: Any, request: Any, state: KeptState) -> None:
    pool = manager.block_pool
    block = state.copy
    if block is None:
        # Not copied out yet: the key is still on the running block; forget the pending copy.
        pending = manager._partial_hit_reqs.get(request.request_id)
        if pending is None or pending[1] is not state.holder:
            return
        manager._partial_hit_reqs.pop(request.request_id, None)
        manager._producer_partial_tail_reqs.pop(request.request_id, None)
        block = state.holder
    # The block may have been evicted and reused since: only remove it while it carries this key.
    if block.block_hash == state.key or pool.cached_block_hash_to_block.contain(state.key, block.block_id):
        pool.evict_blocks({block.block_id})
