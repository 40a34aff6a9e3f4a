"""Which request-end states the CPU tier takes (``cpu_tier_request_ends``: auto, store, skip).

A request hands the CPU tier, besides its attention blocks and the Mamba states at
chunk ends, the Mamba state at its own end: the prompt's last prefix-match unit
boundary (and with ``mamba_output_checkpoint`` the newest kept answer position), plus
the attention block that holds that boundary when it lies inside one (the "partial
tail"). Off the Mamba block grid, that state serves one later request only: the next
turn of the same conversation (an exact replay, or a continuation through the answer).
On a tier that turns over faster than conversations continue, storing it evicts
attention KV and states that other requests would have reused. Replays of the Mooncake
traces (Qwen3-Next, unit 16, 40 GiB GPU, vLLM 0.33), ``store`` -> ``skip``: 160 GiB tier,
conversation 0.522 -> 0.581 of the ideal, synthetic 0.597 -> 0.651; with
``mamba_divergence_checkpoint`` at 480 GiB, 0.934 -> 0.949 and 0.923 -> 0.946. ``skip``
loses where the tier never fills (the first 300 conversation requests: 0.617 -> 0.613).
The default, ``auto``, takes them while the tier still has never-used blocks and declines
them once a store would evict: 0.617 there, 0.577 and 0.649 at 160 GiB (docs/features.md).
With the stock SimpleCPU scheduler (``fine_grained_hits: false`` up to 0.29) it does nothing.

:class:`RequestEndAdmission` sits in front of the connector's SimpleCPU scheduler side
(the wheel's own on 0.30+, the backport up to 0.29) and only removes candidates before
that scheduler sees them; it allocates and evicts nothing in the CPU pool.
Invariants:

- a Mamba hand-off is declined iff its boundary is off the grid of its group's Mamba
  block, at or past the request's prompt-tail start (:func:`prompt_tail_start`: (N - 1)
  floored to the unit, N the prompt length, so the native replay position and the
  prompt's last unit boundary both qualify; one unit lower where the tail state moves
  under EAGLE block drop (``tail_drop``: ``prompt_tail_checkpoint`` on 0.29+, the wheel
  itself on 0.30+), e.g. N=300, unit 16: 272, not 288) and not the request's divergence
  point (``shared_prefix_boundary``, which other requests share by construction);
- the attention partial tail is declined iff the position a hit through it resumes at (its
  boundary; one unit lower where the CPU tier's own lookup drops the drafter's unit,
  ``resume_drop``: 0.27+ under EAGLE) is off the Mamba grid, not the divergence point, and
  the tier neither holds nor is storing the Mamba state there: a partial tail whose state the
  tier keeps is always stored, so a state is never left on the tier without the attention that
  reaches it (``auto``: a request whose end state was stored before the tier first filled and
  that finishes after);
- with ``auto`` nothing is declined while the block at the head of the CPU pool's free queue (the
  next one a store takes) has never held a copy: a store then evicts nothing;
- states on the Mamba grid, chunk ends inside the prompt and divergence states are
  passed through unchanged; the GPU prefix cache keeps every declined state as before;
- each declined state is counted once, as the outcome ``declined_request_end`` of the
  connector's ``get_boundary_store_stats()`` (``published`` includes it); up to 0.30 it
  reaches ``vllm:simple_kv_offload_save_outcomes_total`` too, not on 0.31+ (vLLM's own series).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from hybrid_kv_plugin._log import log_once
from hybrid_kv_plugin.config import PluginConfigError
from hybrid_kv_plugin.offload.stats import StoreOutcome

# The choices of ``kv_connector_extra_config.cpu_tier_request_ends``.
STORE = "store"
SKIP = "skip"
AUTO = "auto"
DECLINED = StoreOutcome.DECLINED_REQUEST_END.value


def check_cpu_tier_request_ends(value: str, mode: Any, adapter: Any) -> None:
    """Refuse ``skip`` where the connector runs the wheel's stock SimpleCPU scheduler (it consumes
    no Mamba hand-offs, so there is nothing to decline); ``auto`` does nothing there."""
    from hybrid_kv_plugin.offload.mode import OffloadMode

    if value == SKIP and mode is OffloadMode.STOCK:
        raise PluginConfigError(
            "invalid hybrid-kv-plugin configuration: kv_connector_extra_config.cpu_tier_request_ends: 'skip' "
            "needs the fine-grained hybrid SimpleCPU connector (fine_grained_hits true, a hybrid model with "
            f"prefix caching), and this connector runs the stock one on vLLM {adapter.version} (allowed here: store)"
        )


def prompt_tail_start(num_prompt_tokens: int, unit: int, tail_drop: bool) -> int:
    """The lowest position at which a wheel or ``prompt_tail_checkpoint`` keeps a prompt's tail
    Mamba state: the last unit boundary <= N-1 (the replay position; the prompt's last unit
    boundary and the 0.32+ positions are at or above it), one unit lower where the tail moves
    under EAGLE block drop (``tail_drop``). Anything below is a chunk end inside the prompt."""
    return (num_prompt_tokens - 1) // unit * unit - (unit if tail_drop else 0)


def mamba_groups(kv_cache_config: Any) -> dict[int, int]:
    """{group index: block size} of the Mamba groups (empty for a model without one)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    return {i: g.kv_cache_spec.block_size for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)}


def attach_request_end_admission(
    connector: Any,
    kv_cache_config: Any,
    tail_boundary: Callable[[Any, int], int],
    tail_drop: bool = False,
    resume_drop: bool = False,
) -> RequestEndAdmission | None:
    """The admission ``connector``'s options ask for, on its scheduler side (None: store everything,
    the worker side, the stock SimpleCPU scheduler, or a model without Mamba groups).
    ``tail_boundary(request, unit)``: where the scheduler side keys a finished request's attention
    partial tail; ``tail_drop``/``resume_drop``: see the module's invariants."""
    from hybrid_kv_plugin.offload.mode import OffloadMode

    ends = connector.hybrid_kv_options.cpu_tier_request_ends
    if ends == STORE or connector.offload_mode is OffloadMode.STOCK:
        return None
    manager = getattr(connector, "scheduler_manager", None)
    groups = mamba_groups(kv_cache_config)
    if manager is None or not groups:
        return None

    adapter = connector.hybrid_kv_adapter
    if ends == AUTO and not adapter.reads_next_free_block(manager.cpu_block_pool):
        # auto reads which block a store takes next; without that the tier takes every end (store).
        log_once(
            logging.WARNING,
            "hybrid-kv-plugin: cpu_tier_request_ends auto acts as store: vLLM %s's CPU pool has no free "
            "queue head to read (skip still works)",
            adapter.version,
        )
        return None
    # The backport counts declines with its own outcomes (and their metrics growth); on 0.30+
    # the connector adds them to the wheel's counters when asked.
    record = manager._record_outcomes if connector.offload_mode is OffloadMode.BACKPORT else None
    next_free_block = adapter.next_free_block if ends == AUTO else None
    return RequestEndAdmission(
        manager, adapter.simplecpu_partial_tail_finder, groups, tail_boundary, record, next_free_block, tail_drop,
        resume_drop,
    )


class RequestEndAdmission:
    """Declines request-end states off the Mamba grid for one SimpleCPU scheduler side."""

    def __init__(
        self,
        manager: Any,
        partial_tail_finder: str,
        mamba_groups: dict[int, int],
        tail_boundary: Callable[[Any, int], int],
        record: Callable[[dict[str, int]], None] | None = None,
        next_free_block: Callable[[Any], Any] | None = None,
        tail_drop: bool = False,
        resume_drop: bool = False,
    ) -> None:
        self.manager = manager
        # ``auto``: decline only once a store would evict (see takes_request_ends); the adapter's
        # reader of the block a pool hands out next. None: ``skip``, decline always.
        self._next_free_block = next_free_block
        self.only_when_full = next_free_block is not None
        self._tail_boundary = tail_boundary
        self._record = record
        self.unit = manager.hash_block_size
        self.tail_drop = tail_drop
        self.resume_drop = resume_drop
        self.grid = frozenset(mamba_groups.values())
        self._mamba_group_ids = tuple(mamba_groups)
        self.declined_states = 0
        self.declined_partial_tails = 0
        # Declined states counted since the scheduler side's counters last started over (a CPU cache
        # reset gives it a new counters object); the connector adds them to get_boundary_store_stats().
        self._counters: Any = None
        self._declined_since_reset = 0
        # (request id, boundary) of the hand-offs the last step declined (the replay's loss split reads it).
        self.declined_this_step: set[tuple[str, int]] = set()
        if hasattr(manager, "partial_tail_filter"):
            # The backport's own hook, a slot (an instance attribute added later would move its
            # attributes out of inline storage for every step).
            manager.partial_tail_filter = self._filter_partial_tail
        else:
            # The wheel's scheduler (0.30+): bound on this instance only, the class stays the wheel's.
            find = getattr(manager, partial_tail_finder)

            def partial_tail(request: Any, block_ids: Any) -> Any:
                found = find(request, block_ids)
                return None if found is None else self._filter_partial_tail(request, found)

            setattr(manager, partial_tail_finder, partial_tail)

    def _filter_partial_tail(self, request: Any, tail: Any) -> Any:
        """``tail`` unless the admission declines the partial tail of ``request`` (then None)."""
        if self.takes_request_ends():
            return tail
        boundary = self._tail_boundary(request, self.unit)
        # Where a hit through the tail resumes: one unit lower where the CPU tier's lookup drops it.
        resumes_at = boundary - self.unit if self.resume_drop else boundary
        if self._declines(request, resumes_at) and not self._state_kept(request, resumes_at):
            self.declined_partial_tails += 1
            return None
        return tail

    def takes_request_ends(self) -> bool:
        """Whether the tier takes request ends now: never with ``skip``; with ``auto`` while the next
        block a store takes from the CPU pool holds no cached copy (a store evicts nothing). The
        pool hands out such blocks before cached ones (adapter ``next_free_block``), so with
        ``auto`` this stays true until the tier first evicts."""
        if self._next_free_block is None:
            return False
        head = self._next_free_block(self.manager.cpu_block_pool)
        return head is not None and head.block_hash is None

    def _declines(self, request: Any, resumes_at: int) -> bool:
        """Whether a partial tail whose hit resumes at ``resumes_at`` is a request end: off the Mamba
        grid, and not the request's divergence point (other requests share that by construction)."""
        if resumes_at == getattr(request, "shared_prefix_boundary", 0):
            return False
        return any(resumes_at % size for size in self.grid)

    def _state_kept(self, request: Any, resumes_at: int) -> bool:
        """Whether the CPU tier holds, or is storing, every Mamba group's state at ``resumes_at``
        (``auto``: a request end stored before the tier first filled)."""
        if resumes_at <= 0 or resumes_at > len(request.block_hashes) * self.unit:
            return False
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        manager = self.manager
        gpu_cached = manager._gpu_block_pool.cached_block_hash_to_block
        cpu_cached = manager.cpu_block_pool.cached_block_hash_to_block
        in_flight = manager._in_flight_store_gpu_blocks
        block_hash = request.block_hashes[resumes_at // self.unit - 1]
        for group in self._mamba_group_ids:
            key = make_block_hash_with_group_id(block_hash, group)
            if cpu_cached.get_one_block(key) is not None:
                continue
            # A copy in flight: its GPU source, still cached under the key, is being stored.
            source = gpu_cached.get_one_block(key)
            if source is None or source.block_id not in in_flight:
                return False
        return True

    def declined_since_reset(self) -> int:
        """Hand-offs declined since the scheduler side's counters last started over."""
        return self._declined_since_reset if self._counters is self.manager.boundary_store_stats else 0

    def _count(self, declined: int) -> None:
        self.declined_states += declined
        counters = self.manager.boundary_store_stats
        if counters is not self._counters:
            self._counters, self._declined_since_reset = counters, 0
        self._declined_since_reset += declined
        if self._record is not None:
            self._record({DECLINED: declined})

    def filter_step(self, scheduler_output: Any) -> None:
        """Remove this step's declined hand-offs from ``kv_connector_block_state`` (in place:
        the SimpleCPU scheduler side reads them from there next)."""
        if self.declined_this_step:  # runs every step: no new set unless the last step declined some
            self.declined_this_step = set()
        # A field of the output on 0.29+; set for the connector's call on 0.26-0.28 (boundary_handoff_publish).
        block_state = scheduler_output.kv_connector_block_state
        handoffs = None if block_state is None else block_state.boundary_state_offloads
        if not handoffs or self.takes_request_ends():
            return
        tracked = self.manager._reqs_to_store
        sizes = self.manager.group_block_sizes
        unit, tail_drop = self.unit, self.tail_drop
        for req_id, entries in handoffs.items():
            state = tracked.get(req_id)
            if state is None:
                continue  # the scheduler side counts it as gone
            request = state.request
            tail_start = prompt_tail_start(request.num_prompt_tokens, unit, tail_drop)
            divergence = getattr(request, "shared_prefix_boundary", 0)
            kept = [
                entry for entry in entries
                if entry[2] % sizes[entry[0]] == 0 or entry[2] < tail_start or entry[2] == divergence
            ]
            if len(kept) < len(entries):
                self._count(len(entries) - len(kept))
                self.declined_this_step.update((req_id, e[2]) for e in entries if e not in kept)
                handoffs[req_id] = kept
