"""Eviction order of the SimpleCPU tier for a hybrid model (``cpu_tier_eviction: "hybrid"``).

The tier is the wheel's own ``BlockPool`` (``cpu_block_pool``): free blocks wait in an LRU
queue, a store takes new blocks from its head (evicting what they held) and a published copy
or a block released after a load goes to its tail. Two things make plain LRU a poor fit for
a hybrid model, where a Mamba state costs one block per Mamba group (Qwen3-Next: 3 blocks,
36 state pages, against 12 attention pages for 544 tokens of attention KV):

* **reuse from the GPU cache is invisible**: a prefix that every turn of a conversation reuses
  from the GPU cache is never loaded from the tier, so its CPU copy ages as if unused and is
  evicted first, just before the GPU cache drops it too;
* **intermediate states are the cheapest to lose**: a prefill that runs in several chunks
  hands off a Mamba state at each chunk end. The same request's prompt-end state (and its
  answer-end state) supersedes them for every continuation of that request; they help only a
  later request that branches off exactly between them, yet each costs as much as the
  prompt-end state.

:class:`HybridTierPolicy` changes the order, not the pool: it is attached to one connector's
CPU pool (instance attributes; the ``BlockPool`` class is not patched) and only moves free
blocks inside the free queue. Invariants:

- a block the policy moves is free (``ref_cnt == 0``) and still carries the key it was
  chosen under; blocks in use, in flight or re-used for other content are never touched;
- the pool's own ``get_new_blocks`` still does every allocation, eviction, event and metric:
  the policy only puts its victims at the head of the queue just before, and only as many
  as the allocation evicts (never-used blocks at the head are taken first, as in LRU);
- **reuse**: every block that a newly scheduled request reuses from the GPU prefix cache has
  its CPU copy (same key) moved to the MRU end, as a CPU load would;
- **intermediate**: when a request hands off a Mamba state deeper than one it handed off
  before, the earlier one is *superseded*; a superseded state that is not at a prompt-tail
  position (the prompt's last unit boundary, or the last one <= N-1; where the tail moves
  under EAGLE block drop also the unit below: ``offload.admission.prompt_tail_start``) and not the request's
  divergence point (``shared_prefix_boundary``) is *demoted*: chunk ends inside the prompt and
  answer states a later answer state supersedes. Its copy (once published) is
  evicted before any LRU block, oldest demotion first, **while demoting pays**. A request's
  deepest state is never demoted. A demoted copy that a request loads or reuses returns to
  plain LRU;
- **while demoting pays**: the demotion is a bet on the workload. It wins on chats that
  continue where the last turn ended and loses on prefix trees whose requests branch off at
  the demoted chunk ends. Each request's CPU-tier lookup is run twice more, each time with one
  class of evicted keys (demoted, plain LRU) counted as held (offload/ghosts.py); the tokens
  more it would hit are charged to that class. Demoted copies go first while they have cost no
  more tokens per evicted block than plain ones; an eviction counts for whoever chose it (the
  order's victims are demoted, LRU's picks plain); the counts decay with the workload.

``hybrid-kv replay`` (Qwen3-Next, unit 16, 40/160 GiB, vLLM 0.33, ``plugin+divergence+hybrid-tier``):
Mooncake conversation trace (first 2,000 requests) 0.688 of the ideal with the bet always on,
0.696 judged (LRU: 0.630); synthetic trace (3,993 requests branching off long shared prefixes)
0.552 always on, 0.637 judged (LRU: 0.652). Opt-in, per deployment.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from hybrid_kv_plugin.config import PluginConfigError
from hybrid_kv_plugin.offload.admission import prompt_tail_start
from hybrid_kv_plugin.offload.ghosts import DEMOTED, PLAIN, EvictionGhosts

# The choices of ``kv_connector_extra_config.cpu_tier_eviction``.
LRU = "lru"
HYBRID = "hybrid"


def check_cpu_tier_eviction(value: str, mode: Any, adapter: Any) -> None:
    """Refuse ``hybrid`` at start-up where the connector runs the wheel's stock SimpleCPU scheduler
    (``fine_grained_hits: false`` up to 0.29, or a model without the hybrid layout): it consumes no
    Mamba boundary hand-offs and its CPU hits stop at whole Mamba blocks."""
    from hybrid_kv_plugin.offload.mode import OffloadMode

    if value == HYBRID and mode is OffloadMode.STOCK:
        raise PluginConfigError(
            "invalid hybrid-kv-plugin configuration: kv_connector_extra_config.cpu_tier_eviction: 'hybrid' "
            "needs the fine-grained hybrid SimpleCPU connector (fine_grained_hits true, a hybrid model with "
            f"prefix caching), and this connector runs the stock one on vLLM {adapter.version} (allowed here: lru)"
        )


def attach_cpu_tier_policy(connector: Any, tail_drop: bool = False) -> HybridTierPolicy | None:
    """The policy ``connector``'s options ask for, on its scheduler side (None: LRU, or the worker side).
    ``tail_drop``: whether the prompt's tail state sits one unit lower (EAGLE block drop)."""
    if connector.hybrid_kv_options.cpu_tier_eviction != HYBRID:
        return None
    manager = getattr(connector, "scheduler_manager", None)
    if manager is None:
        return None  # the worker side keeps no CPU pool
    adapter = connector.hybrid_kv_adapter
    if not adapter.reads_next_free_block(manager.cpu_block_pool):
        # The order reads which copies an allocation evicts; without that it cannot keep its invariants.
        raise PluginConfigError(
            "invalid hybrid-kv-plugin configuration: kv_connector_extra_config.cpu_tier_eviction: 'hybrid' "
            f"reads the CPU pool's free queue, which vLLM {adapter.version}'s pool does not expose "
            "(allowed here: lru)"
        )
    return HybridTierPolicy(manager, manager.hash_block_size, adapter.free_blocks_at_head, tail_drop)


class HybridTierPolicy:
    """The hybrid eviction order on one SimpleCPU scheduler's CPU pool."""

    def __init__(
        self,
        manager: Any,
        hash_block_size: int,
        free_blocks_at_head: Callable[[Any, int], list[Any]],
        tail_drop: bool = False,
    ) -> None:
        self.manager = manager
        self.pool = manager.cpu_block_pool
        self.unit = hash_block_size
        self.tail_drop = tail_drop  # the prompt tail sits one unit lower (prompt_tail_start)
        # The adapter's read of the blocks the pool hands out next (not taken).
        self._at_head = free_blocks_at_head
        # Per running request: its deepest state handed off so far (boundary, keys).
        self._deepest: dict[str, tuple[int, list[Any]]] = {}
        # Keys of hand-offs staged as intermediate, until their copy is published (insertion order).
        self._pending: dict[Any, None] = {}
        # Published demoted copies, oldest first: block id -> (block, the key it was demoted under).
        self.demoted: dict[int, tuple[Any, Any]] = {}
        self.stats = {"demoted": 0, "evicted_demoted": 0, "promoted": 0, "refreshed": 0, "demotion_withheld": 0}
        from vllm.v1.core.kv_cache_utils import KVCacheBlock, make_block_hash_with_group_id

        # Whether demoting pays on this workload: evicted keys by class, and what-if lookups
        # (judge_lookup) that count one class's evicted keys as held.
        self.ghosts = EvictionGhosts(len(self.pool.blocks))
        self._group_key = make_block_hash_with_group_id
        self._reviving: int | None = None  # the class a what-if lookup counts as held
        self._stand_in = KVCacheBlock(block_id=-1)  # what a what-if lookup finds for such a key
        self._judging: str | None = None
        self._judged: set[str] = set()  # requests judged once already (forgotten when they finish)
        coordinator = manager.cpu_coordinator
        self._find = coordinator.find_longest_cache_hit
        coordinator.find_longest_cache_hit = self._find_longest_cache_hit
        pool = self.pool
        self._get_new_blocks = pool.get_new_blocks
        self._free_blocks = pool.free_blocks
        self._touch = pool.touch
        self._get_cached_block = pool.get_cached_block
        pool.get_new_blocks = self.get_new_blocks
        pool.free_blocks = self.free_blocks
        pool.touch = self.touch
        pool.get_cached_block = self.get_cached_block

    # ------------------------------------------------------------------ the pool's calls
    def get_new_blocks(self, num_blocks: int) -> list[Any]:
        queue = self.pool.free_block_queue
        if num_blocks > queue.num_free_blocks:
            return self._get_new_blocks(num_blocks)  # the pool refuses it as usual
        victims: list[Any] = []
        if self.demoted:
            if self.ghosts.demotion_pays():
                need = num_blocks - self._unhashed_at_head(num_blocks)
                victims = self._victims(need) if need > 0 else []
            else:
                self.stats["demotion_withheld"] += 1
            if victims:
                for block in victims:
                    queue.remove(block)
                queue.prepend_n(victims)
                self.stats["evicted_demoted"] += len(victims)
        self._record_evictions(num_blocks, len(victims))
        return self._get_new_blocks(num_blocks)

    def _unhashed_at_head(self, limit: int) -> int:
        """Free blocks without a key at the head of the queue (up to ``limit``): taking them evicts nothing."""
        count = 0
        for block in self._at_head(self.pool, limit):
            if block.block_hash is not None:
                break
            count += 1
        return count

    def _record_evictions(self, num_blocks: int, num_victims: int) -> None:
        """Remember the keys the next ``num_blocks`` taken from the head of the queue held; the
        first ``num_victims`` hashed ones are the demoted victims just moved there."""
        demoted = self.demoted
        for block in self._at_head(self.pool, num_blocks):
            key = block.block_hash
            if key is not None:
                if num_victims:
                    num_victims -= 1
                    self.ghosts.evicted_key(key, True)
                else:  # LRU's own pick (a demoted copy too, while the bet is withheld): LRU's cost
                    demoted.pop(block.block_id, None)
                    self.ghosts.evicted_key(key, False)

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None:
        blocks = list(ordered_blocks)
        self._free_blocks(blocks)
        if not self._pending:
            return
        pending = self._pending
        for block in blocks:
            key = block.block_hash
            if key is not None and key in pending and block.ref_cnt == 0:
                del pending[key]
                self._mark_demoted(block, key)

    def touch(self, blocks: Sequence[Any]) -> None:
        # A load pins the blocks it reads: a demoted state that serves a hit is worth keeping.
        if self.demoted:
            for block in blocks:
                self._promote(block)
        self._touch(blocks)

    def _victims(self, need: int) -> list[Any]:
        victims: list[Any] = []
        demoted = self.demoted
        while demoted and len(victims) < need:
            block_id = next(iter(demoted))
            block, key = demoted.pop(block_id)
            # Evicted by LRU meanwhile (and maybe reused), or in use: not a victim.
            if block.ref_cnt == 0 and block.block_hash == key:
                victims.append(block)
        return victims

    def get_cached_block(self, block_hash: Any, kv_cache_group_ids: list[int]) -> Any:
        """The pool's lookup; inside a what-if lookup, an evicted key of the class being judged
        counts as held (its block is a stand-in nobody takes)."""
        found = self._get_cached_block(block_hash, kv_cache_group_ids)
        if found is not None or self._reviving is None:
            return found
        # A what-if lookup: keys of the class being judged count as held.
        lookup = self.pool.cached_block_hash_to_block.get_one_block
        blocks = []
        for group_id in kv_cache_group_ids:
            key = self._group_key(block_hash, group_id)
            block = lookup(key)
            if block is None:
                if self.ghosts.kind(key) != self._reviving:
                    return None
                block = self._stand_in
            blocks.append(block)
        return blocks

    # ------------------------------------------------------------------ judging the demotion bet
    def judge_lookup(self, request_id: str | None) -> None:
        """The next coordinator lookup answers ``request_id`` (None: no request): judge it, once
        per request."""
        self._judging = None if request_id in self._judged else request_id

    def _find_longest_cache_hit(self, block_hashes: Any, max_cache_hit_length: int) -> Any:
        """The CPU coordinator's lookup; for a request being judged, the same lookup again once per
        class with that class's evicted keys counted as held: the tokens more it hits are what
        the class's evictions cost this request."""
        result = self._find(block_hashes, max_cache_hit_length)
        request_id, self._judging = self._judging, None
        if request_id is None or not len(self.ghosts):
            return result
        self._judged.add(request_id)
        hit = result[1]
        for kind in (PLAIN, DEMOTED):
            self._reviving = kind
            try:
                self.ghosts.charge(kind, self._find(block_hashes, max_cache_hit_length)[1] - hit)
            finally:
                self._reviving = None
        return result

    # ------------------------------------------------------------------ what the connector tells it
    def observe_step(self, scheduler_output: Any, gpu_pool: Any) -> None:
        """Before the step's stores are staged: refresh reused copies, classify hand-offs."""
        if gpu_pool is None:
            return
        self._refresh_reused(scheduler_output, gpu_pool)
        self.forget(scheduler_output.finished_req_ids)
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        handoffs = block_state.boundary_state_offloads if block_state is not None else None
        if handoffs:
            self._classify_handoffs(handoffs, gpu_pool)

    def _refresh_reused(self, scheduler_output: Any, gpu_pool: Any) -> None:
        new_reqs = scheduler_output.scheduled_new_reqs
        if not new_reqs:
            return
        gpu_blocks = gpu_pool.blocks
        lookup = self.pool.cached_block_hash_to_block.get_one_block
        queue = self.pool.free_block_queue
        for new in new_reqs:
            if not new.num_computed_tokens:
                continue
            reused = []
            for ids in new.block_ids:
                for block_id in ids:
                    key = gpu_blocks[block_id].block_hash
                    if key is None:
                        continue  # the null block, or one not computed yet
                    cpu_block = lookup(key)
                    if cpu_block is not None and cpu_block.ref_cnt == 0:
                        reused.append(cpu_block)
            # Deepest first, as the GPU pool frees a request's blocks: the prefix head stays longest.
            for cpu_block in reversed(reused):
                queue.remove(cpu_block)
                queue.append(cpu_block)
                self._promote(cpu_block)
            self.stats["refreshed"] += len(reused)

    def _classify_handoffs(self, handoffs: dict[str, Any], gpu_pool: Any) -> None:
        states = getattr(self.manager, "_reqs_to_store", {})
        gpu_blocks = gpu_pool.blocks
        for req_id, entries in handoffs.items():
            state = states.get(req_id)
            if state is None:
                continue
            # One state is one hand-off per Mamba group at the same boundary.
            by_boundary: dict[int, list[Any]] = {}
            for _group, gpu_block_id, boundary in entries:
                key = gpu_blocks[gpu_block_id].block_hash
                if key is not None:
                    by_boundary.setdefault(boundary, []).append(key)
            for boundary in sorted(by_boundary):
                self._handed_off(req_id, state.request, boundary, by_boundary[boundary])
        # Keys whose copy is never published (skipped, dropped) must not pile up.
        excess = len(self._pending) - 4 * len(self.pool.blocks)
        if excess > 0:
            for key in list(self._pending)[:excess]:
                del self._pending[key]

    def _handed_off(self, req_id: str, request: Any, boundary: int, keys: list[Any]) -> None:
        """The request's newest state; the one it supersedes is demoted where it is intermediate."""
        deepest = self._deepest.get(req_id)
        if deepest is not None and boundary <= deepest[0]:
            superseded = boundary, keys  # a later hand-off below the deepest one (a re-key)
        else:
            superseded, self._deepest[req_id] = deepest, (boundary, keys)
        if superseded is not None and self.is_intermediate(request, superseded[0]):
            self._demote(superseded[1])

    def _demote(self, keys: list[Any]) -> None:
        lookup = self.pool.cached_block_hash_to_block.get_one_block
        for key in keys:
            block = lookup(key)
            if block is not None and block.ref_cnt == 0:  # already published
                self._mark_demoted(block, key)
            else:
                self._pending[key] = None

    def _mark_demoted(self, block: Any, key: Any) -> None:
        self.demoted[block.block_id] = (block, key)
        self.stats["demoted"] += 1

    def _promote(self, block: Any) -> None:
        """A demoted copy that serves a request returns to plain LRU."""
        if self.demoted.pop(block.block_id, None) is not None:
            self.stats["promoted"] += 1

    def cache_reset(self) -> None:
        """The CPU cache was reset (every copy dropped, no store in flight): nothing is demoted or
        waiting to be, and keys evicted before are no loss of an eviction class any more."""
        self.demoted.clear()
        self._pending.clear()
        self.ghosts.forget_keys()

    def forget(self, req_ids: Iterable[str]) -> None:
        """Requests that left: no later hand-off of theirs will supersede anything."""
        for req_id in req_ids:
            self._deepest.pop(req_id, None)
            self._judged.discard(req_id)

    def is_intermediate(self, request: Any, boundary: int) -> bool:
        """Whether a superseded state at ``boundary`` may go first: anything but the prompt's tail
        (from :func:`prompt_tail_start` to N: the last one <= N-1 and the prompt's last unit
        boundary are both kept, the wheel or ``prompt_tail_checkpoint`` puts the tail state at
        either; where the tail moves under EAGLE block drop both move one unit down, and ``both``
        keeps two states there on 0.29-0.31, e.g. N=336, unit 16: 304 and 320; an exact replay
        resumes there)
        and the request's divergence point. An answer state a deeper one of the same answer
        supersedes (``mamba_output_checkpoint`` keeps one per unit of the answer) goes first."""
        prompt = request.num_prompt_tokens
        if prompt_tail_start(prompt, self.unit, self.tail_drop) <= boundary <= prompt:
            return False
        return boundary != getattr(request, "shared_prefix_boundary", None)

