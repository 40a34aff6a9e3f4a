"""A simulated worker that moves bytes: content tags in GPU and CPU cache tensors.

:class:`ByteCache` keeps one small int64 tensor per tier (the GPU KV cache and the
SimpleCPU tier, indexed by block id like the wheel's one shared allocation that
every KV-cache group overlays) and plays the model runner's side of each step:

- it keeps the runner's own block table per request, built only from the scheduler
  output (new requests, appended ``new_block_ids``, resumed requests replaced);
- it zeroes ``new_block_ids_to_zero`` and applies ``kv_cache_block_copies`` (the
  Mamba copy-on-write copies) before the forward pass, as ``_update_states`` does;
- in ``align`` mode it copies a request's Mamba state from its previous state
  block to block ``cdiv(seq_len, block) - 1`` before the forward pass and writes
  the state after the chunk there, as ``preprocess_mamba`` and the model do;
- the forward writes each attention slot with a tag of the token prefix it holds,
  and each Mamba state block with a tag of the exact position it is the state after;
- SimpleCPU loads and stores copy tags through exactly the block ids of the
  connector metadata, when the worker reports them done (or at a preemption
  flush); a failed load poisons its destination blocks;
- speculative drafts the worker did not accept (the simulated worker accepts none)
  leave the request's own next step starting below what the previous one wrote:
  the runner keeps the state after the accepted tokens and overwrites the rejected
  positions, so the partly filled slot and the state are those of the accepted end.

A tag is derived from the content only: a polynomial hash of the token ids up to
its end position, the end position and the KV-cache group. Checks (violations are
collected with step and request; :meth:`check` names them all):

1. **Loads**: after a load completes, every loaded block holds the tag of the
   prefix its position in the request says (attention: the slot's tokens up to the
   hit; Mamba: the state after exactly the hit boundary, or the block's end when
   a wheel loads earlier states too).
2. **Reads**: before each chunk, what the forward pass reads holds the request's
   own prefix: at a fresh hit (first chunk, resume) every attention slot below the
   hit and the Mamba state at the hit; later, the partly filled slot and the state.
3. **In-flight sources**: a transfer's source block did not change between the
   step that issued it and its completion.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Tag layout (int64): the high 36 bits of a mixed prefix hash, 24 bits of end
# position, 4 bits of KV-cache group. 0 is a zeroed block; -1 a failed load's.
_END_BITS = 24
_GROUP_BITS = 4
_LOW_MASK = np.uint64((1 << (_END_BITS + _GROUP_BITS)) - 1)
_BASE = np.uint64(0x100000001B3)  # odd multiplier of the token polynomial
_MIX = np.uint64(0x9E3779B97F4A7C15)
ZEROED = 0
POISONED = -1
_MAX_END = (1 << _END_BITS) - 2
_M64 = (1 << 64) - 1


class _Powers:
    """BASE ** (i + 1) modulo 2**64, grown on demand."""

    def __init__(self) -> None:
        self.table = np.cumprod(np.full(4096, _BASE, dtype=np.uint64))

    def get(self, start: int, stop: int) -> np.ndarray:
        while len(self.table) < stop:
            tail = self.table[-1] * np.cumprod(np.full(len(self.table), _BASE, dtype=np.uint64))
            self.table = np.concatenate([self.table, tail])
        return self.table[start:stop]

    def at(self, i: int) -> int:
        """``BASE ** (i + 1)`` as a Python int (one decode token: no slice, no list)."""
        if i >= len(self.table):
            self.get(i, i + 1)
        return self.table.item(i)


class _Prefix:
    """Hashes of a request's token prefixes: ``h[p]`` covers tokens ``[0, p)``.

    The hashes live in a buffer that doubles when full, so a decode (one more token a
    step) costs O(1) amortised instead of a copy of every earlier hash.
    """

    __slots__ = ("buf", "known", "last")

    def __init__(self) -> None:
        self.buf = np.zeros(1, dtype=np.uint64)
        self.known = 0  # tokens hashed: buf[: known + 1] is valid
        self.last = 0  # buf[known] as a Python int

    @property
    def h(self) -> np.ndarray:
        return self.buf[: self.known + 1]

    def upto(self, tokens: Sequence[int], stop: int, powers: _Powers, pad: int | None = None) -> np.ndarray:
        """``pad``: the token at every position from ``len(tokens)`` up to ``stop``."""
        known = self.known
        if stop == known + 1 and stop < len(self.buf):
            # One decode token, the common step: Python ints only (same sum, modulo 2**64).
            token = pad if pad is not None and known >= len(tokens) else tokens[known]
            h = self.last = (self.last + (int(token) + 1) * powers.at(known)) & _M64
            self.buf[stop] = h
            self.known = stop
            return self.buf[: stop + 1]
        if stop > known:
            ids = tokens[known:stop]
            if pad is not None:
                ids = [*ids, *[pad] * (stop - max(known, len(tokens)))]
            if stop + 1 > len(self.buf):
                grown = np.empty(max(stop + 1, 2 * len(self.buf)), dtype=np.uint64)
                grown[: known + 1] = self.buf[: known + 1]
                self.buf = grown
            if stop - known <= 8:
                # A decode's token or two: Python ints modulo 2**64 give numpy's wrapped sums
                # at a fraction of its per-call cost.
                h = int(self.buf[known])
                for k, (token, power) in enumerate(zip(ids, powers.get(known, stop).tolist())):
                    h = (h + (int(token) + 1) * power) & _M64
                    self.buf[known + 1 + k] = h
            else:
                new = np.asarray(ids, dtype=np.uint64) + np.uint64(1)
                self.buf[known + 1 : stop + 1] = np.cumsum(new * powers.get(known, stop), dtype=np.uint64) + self.buf[known]
            self.known = stop
            self.last = self.buf.item(stop)
        return self.buf[: self.known + 1]


def prefix_hashes(token_ids: Sequence[int]) -> np.ndarray:
    """``h[p]`` for every prefix of ``token_ids`` (what a request holding them would get)."""
    return _Prefix().upto(token_ids, len(token_ids), _Powers())


def make_tags(prefix_hashes: np.ndarray, ends: np.ndarray, group: int) -> np.ndarray:
    """The content tags of ``group`` blocks holding the prefixes ``[0, end)`` (int64)."""
    ends = np.asarray(ends, dtype=np.int64)
    if ends.size and int(ends.max()) > _MAX_END:
        raise ValueError(f"the byte check encodes positions below {_MAX_END}; got {int(ends.max())}")
    mixed = prefix_hashes[ends] * _MIX
    mixed ^= mixed >> np.uint64(29)
    mixed *= _MIX
    low = (ends.astype(np.uint64) << np.uint64(_GROUP_BITS)) | np.uint64(group)
    return ((mixed & ~_LOW_MASK) | low).view(np.int64)


_MIX_INT = int(_MIX)
_HIGH_INT = _M64 & ~int(_LOW_MASK)


def make_tag(prefix_hashes: np.ndarray, end: int, group: int) -> int:
    """``make_tags`` for one end position, in Python ints (a decode step checks one slot;
    numpy's per-call cost was most of the byte check's time). Same value, bit for bit."""
    if end > _MAX_END:
        raise ValueError(f"the byte check encodes positions below {_MAX_END}; got {end}")
    mixed = (prefix_hashes.item(end) * _MIX_INT) & _M64
    mixed ^= mixed >> 29
    mixed = (mixed * _MIX_INT) & _M64
    tag = (mixed & _HIGH_INT) | (end << _GROUP_BITS) | group
    return tag - (1 << 64) if tag >> 63 else tag


def describe(tag: int) -> str:
    if tag == ZEROED:
        return "zeroed"
    if tag == POISONED:
        return "a failed load's garbage"
    end = (tag >> _GROUP_BITS) & ((1 << _END_BITS) - 1)
    return f"group {tag & ((1 << _GROUP_BITS) - 1)} content up to token {end}"


@dataclass
class ByteStats:
    """What the byte check verified (exact counts for tests and the soak)."""

    loads: int = 0
    loaded_tokens: int = 0  # sum of the hits of loaded requests beyond their local prefix
    loaded_attention_blocks: int = 0
    loaded_mamba_states: int = 0
    fresh_hits: int = 0  # first chunks after a (re)allocation with a nonzero hit
    hit_attention_slots: int = 0
    hit_mamba_states: int = 0
    chunks: int = 0
    stores: int = 0
    failed_loads: int = 0
    # Mamba states of the request's own prefix at an earlier position of the same block,
    # in a geometry whose chunk grid is finer than the Mamba block (see ByteCache).
    off_grid_mamba_states: int = 0


@dataclass
class _Transfer:
    kind: str  # "load" or "store"
    src: Any  # torch index tensors (source tier ids, destination tier ids)
    dst: Any
    snapshot: Any
    step: int
    reqs: list[str] = field(default_factory=list)
    hits: dict[str, tuple[int, int]] = field(default_factory=dict)  # req -> (local, total) at issue
    done: bool = False


class ByteCache:
    def __init__(self, engine: Any, sampled_token: int) -> None:
        import torch
        from vllm.v1.kv_cache_interface import MambaSpec

        self.engine = engine
        self.torch = torch
        self.sampled_token = sampled_token  # the id the engine samples for every output
        self.attention: list[tuple[int, int]] = []  # (group, block size)
        self.mamba: list[tuple[int, int]] = []  # (group, block size), align mode only
        managers = engine.scheduler.kv_cache_manager.coordinator.single_type_managers
        for g, group in enumerate(engine.kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            if isinstance(spec, MambaSpec):
                # The runner indexes states by the spec's block; other modes keep
                # states elsewhere, so only align is modelled.
                if spec.mamba_cache_mode == "align":
                    self.mamba.append((g, spec.block_size))
            else:
                # Tokens per block as the scheduler counts them (x DCP size).
                self.attention.append((g, managers[g].block_size))
        # Every real engine runs align mode with CacheConfig.block_size equal to the Mamba
        # block (vLLM's platform sets it so), and the scheduler ends prefill chunks on that
        # grid. A simulated geometry with a finer grid (FA 16 + Mamba 64 on 0.28+) lets a
        # chunk run past a Mamba block boundary; the slot then keeps the state of the
        # previous chunk end while the Mamba manager caches it as the boundary's. Such
        # states are counted in ``stats.off_grid_mamba_states``, not as violations.
        grid = engine.vllm_config.cache_config.block_size
        self.off_grid = {g for g, bs in self.mamba if bs != grid}
        unit = engine.hash_block_size
        sizes = {bs for _, bs in self.attention}
        # Attention blocks coarser than the prefix-match unit hold one tag per unit,
        # so a hit (or a partial tail) inside a block is checked unit by unit.
        self.slots = max(1, min(bs // unit if bs % unit == 0 else 1 for bs in sizes)) if sizes else 1
        num_blocks = engine.kv_cache_config.num_blocks
        self.gpu = torch.zeros((num_blocks, self.slots), dtype=torch.int64)
        self.cpu = None
        manager = engine.offload_manager
        if manager is not None and hasattr(manager, "cpu_block_pool"):
            self.cpu = torch.zeros((len(manager.cpu_block_pool.blocks), self.slots), dtype=torch.int64)
        self._gpu_of: Any = None  # the tensor ``_gpu_view`` shows (rebuilt if ``gpu`` is replaced)
        self._gpu_view: np.ndarray | None = None
        self.powers = _Powers()
        self.prefixes: dict[str, _Prefix] = {}
        self.tables: dict[str, list[list[int]]] = {}
        self.mamba_state_idx: dict[str, int] = {}
        self.next_position: dict[str, int] = {}
        # Draft tokens each request's last chunk scheduled (speculative decoding).
        self.drafts: dict[str, int] = {}
        # Drafts of a request's earlier chunks still undelivered when its last chunk was scheduled.
        self.undelivered_drafts: dict[str, int] = {}
        self.transfers: dict[tuple[str, int], _Transfer] = {}
        self.violations: list[str] = []
        self.stats = ByteStats()

    # ------------------------------------------------------------------ helpers
    @property
    def _g(self) -> np.ndarray:
        """``gpu`` as a numpy array sharing its memory: indexing it costs far less than torch."""
        if self._gpu_of is not self.gpu:
            self._gpu_of, self._gpu_view = self.gpu, self.gpu.numpy()
        return self._gpu_view  # type: ignore[return-value]

    @property
    def _step(self) -> int:
        return len(self.engine.steps)

    def _hashes(self, req_id: str, stop: int) -> np.ndarray | None:
        request = self.engine.scheduler.requests.get(req_id)
        if request is None:
            return None
        prefix = self.prefixes.get(req_id)
        if prefix is None:
            prefix = self.prefixes[req_id] = _Prefix()
        tokens = request.all_token_ids
        if 0 < stop - len(tokens) <= request.num_output_placeholders:
            # Async scheduling: a decode runs before the scheduler has its input token, the
            # one the worker sampled itself in the step before (always the simulator's token).
            return prefix.upto(tokens, stop, self.powers, pad=self.sampled_token)
        return prefix.upto(tokens, stop, self.powers)

    def _violation(self, text: str) -> None:
        self.violations.append(f"step {self._step}: {text}")

    def _compare(self, req_id: str, what: str, block_ids: list[int], slots: list[int], expected: np.ndarray,
                 off_grid: tuple[np.ndarray, int, int] | None = None) -> None:
        found = self._g[np.asarray(block_ids, dtype=np.int64), np.asarray(slots, dtype=np.int64)]
        wrong = np.nonzero(found != expected)[0]
        if wrong.size and off_grid is not None and self._off_grid_state(int(found[0]), int(expected[0]), *off_grid):
            self.stats.off_grid_mamba_states += 1
            return
        if wrong.size:
            details = ", ".join(
                f"block {block_ids[i]} holds {describe(int(found[i]))}, expected {describe(int(expected[i]))}"
                + ("" if (int(found[i]) ^ int(expected[i])) & int(_LOW_MASK) else " (another prefix)")
                for i in wrong[:4]
            )
            self._violation(f"{req_id}: {what}: {wrong.size} wrong: {details}")

    def _off_grid_state(self, found: int, expected: int, h: np.ndarray, group: int, block_size: int) -> bool:
        """``found`` is this prefix's state at an earlier position of the expected state's block."""
        if group not in self.off_grid or found in (ZEROED, POISONED):
            return False
        end = (found >> _GROUP_BITS) & ((1 << _END_BITS) - 1)
        want = (expected >> _GROUP_BITS) & ((1 << _END_BITS) - 1)
        return (0 < end < want and (end - 1) // block_size == (want - 1) // block_size
                and found == int(make_tags(h, np.array([end]), group)[0]))

    # ------------------------------------------------------------------ the runner's step
    def before_forward(self, scheduler_output: Any) -> None:
        """Block tables, zeroing, copy-on-write copies and a preemption flush, in the runner's order."""
        torch = self.torch
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self.mamba_state_idx.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self.tables[new.req_id] = [list(ids) for ids in new.block_ids]
            self.mamba_state_idx.pop(new.req_id, None)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self.tables[req_id] = [list(ids) for ids in new_ids]
                self.mamba_state_idx.pop(req_id, None)
            elif new_ids is not None:
                for table, ids in zip(self.tables.setdefault(req_id, [[] for _ in new_ids]), new_ids):
                    table.extend(ids)
        zero = getattr(scheduler_output, "new_block_ids_to_zero", None)
        if zero:
            self.gpu[torch.tensor(list(zero), dtype=torch.int64)] = ZEROED
        copies = getattr(scheduler_output, "kv_cache_block_copies", None)
        if copies:
            src = torch.tensor([c.src_block_id for c in copies], dtype=torch.int64)
            dst = torch.tensor([c.dst_block_id for c in copies], dtype=torch.int64)
            self.gpu[dst] = self.gpu[src]
        meta = scheduler_output.kv_connector_metadata
        if meta is not None and getattr(meta, "need_flush", False):
            # The worker synchronizes every transfer before preempted blocks are reused.
            for key in list(self.transfers):
                self.complete(key)

    def forward(self, scheduler_output: Any) -> None:
        """Check what each scheduled chunk reads, then write what it computes."""
        new = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        starts = dict(zip(cached.req_ids, cached.num_computed_tokens))
        starts.update(new)
        drafts = scheduler_output.scheduled_spec_decode_tokens
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            start = starts[req_id]
            table = self.tables.get(req_id)
            h = self._hashes(req_id, start + num_tokens)
            if table is None or h is None:
                self._violation(f"{req_id}: scheduled without a block table the runner knows")
                continue
            self.stats.chunks += 1
            written = self.next_position.get(req_id)
            # Under AsyncScheduler a chunk is scheduled before the request's previous one is delivered:
            # the scheduler counts that chunk's drafts as computed and the runner takes the rejected
            # ones back off the start. The model keeps the scheduler's positions, so a change of that
            # lead (a step without the request, whose next start the runner leaves as it is) widens
            # the rewind by it.
            undelivered = self._undelivered_drafts(req_id) if self.engine.in_flight else 0
            rewind = self.drafts.get(req_id, 0) + self.undelivered_drafts.get(req_id, 0) - undelivered
            if (
                written is not None
                and 0 < written - start <= rewind
                and req_id not in new
                and req_id not in cached.resumed_req_ids
            ):
                self._reject_drafts(req_id, table, start, h)
                written = start
            self.drafts[req_id] = len(drafts.get(req_id, ()))
            self.undelivered_drafts[req_id] = undelivered
            fresh = written != start
            if fresh and start > 0:
                self.stats.fresh_hits += 1
            for group, block_size in self.attention:
                self._attention(req_id, table[group], group, block_size, start, num_tokens, h, fresh)
            # Every Mamba group moves its state from the same previous index (one block size for all).
            prev_state = self.mamba_state_idx.get(req_id)
            for group, block_size in self.mamba:
                self._mamba(req_id, table[group], group, block_size, start, num_tokens, h, fresh, prev_state)
            self.next_position[req_id] = start + num_tokens

    def _undelivered_drafts(self, req_id: str) -> int:
        """Draft tokens of ``req_id``'s chunks in batches the scheduler has not received yet."""
        return sum(len(out.scheduled_spec_decode_tokens.get(req_id, ())) for out, _ in self.engine.undelivered)

    def _reject_drafts(self, req_id: str, table: list[list[int]], start: int, h: np.ndarray) -> None:
        """The runner's view after rejected drafts: the partly filled slot and the state end at ``start``."""
        gpu = self._g
        for group, block_size in self.attention:
            per_slot = block_size // self.slots
            if start % per_slot:
                slot = start // per_slot
                gpu[table[group][slot * per_slot // block_size], slot % self.slots] = make_tag(h, start, group)
        state = self.mamba_state_idx.get(req_id)
        if state is not None:
            for group, _ in self.mamba:
                gpu[table[group][state]] = make_tag(h, start, group)

    def _attention(self, req_id: str, table: list[int], group: int, block_size: int, start: int, num: int,
                   h: np.ndarray, fresh: bool) -> None:
        per_slot = block_size // self.slots
        gpu = self._g
        # Reads: every slot below a fresh hit; else only the slot this chunk continues.
        first_read = 0 if fresh else start // per_slot
        last_read = -(-start // per_slot)
        if last_read - first_read == 1:  # one slot (a decode, a continued chunk): no arrays
            if fresh:
                self.stats.hit_attention_slots += 1
            block = table[first_read * per_slot // block_size]
            expected = make_tag(h, min((first_read + 1) * per_slot, start), group)
            if gpu.item(block, first_read % self.slots) != expected:
                self._compare(req_id, f"attention (group {group}) before tokens {start}..{start + num}",
                              [block], [first_read % self.slots], np.array([expected], dtype=np.int64))
        elif last_read > first_read:
            read = np.arange(first_read, last_read, dtype=np.int64)
            ends = np.minimum((read + 1) * per_slot, start)
            blocks = [table[s] for s in (read * per_slot // block_size).tolist()]
            if fresh:
                self.stats.hit_attention_slots += int(read.size)
            self._compare(req_id, f"attention (group {group}) before tokens {start}..{start + num}",
                          blocks, (read % self.slots).tolist(), make_tags(h, ends, group))
        first_write, last_write = start // per_slot, -(-(start + num) // per_slot)
        if last_write <= first_write:
            return
        if (last_write - 1) * per_slot // block_size >= len(table):
            self._violation(f"{req_id}: tokens {start}..{start + num} have no attention block (table {len(table)})")
            return
        if last_write - first_write == 1:
            block = table[first_write * per_slot // block_size]
            gpu[block, first_write % self.slots] = make_tag(h, min(last_write * per_slot, start + num), group)
            return
        write = np.arange(first_write, last_write, dtype=np.int64)
        blocks = np.asarray(table, dtype=np.int64)[write * per_slot // block_size]
        ends = np.minimum((write + 1) * per_slot, start + num)
        gpu[blocks, write % self.slots] = make_tags(h, ends, group)

    def _mamba(self, req_id: str, table: list[int], group: int, block_size: int, start: int, num: int,
               h: np.ndarray, fresh: bool, prev: int | None) -> None:
        if prev is None:
            prev = (start - 1) // block_size
        curr = -(-(start + num) // block_size) - 1
        self.mamba_state_idx[req_id] = curr
        if curr >= len(table) or (prev >= len(table)):
            self._violation(f"{req_id}: Mamba state index {max(prev, curr)} beyond its table ({len(table)})")
            return
        if table[curr] == 0:
            self._violation(f"{req_id}: Mamba state of tokens ..{start + num} would be written into the null block")
            return
        gpu = self._g
        if prev != -1 and prev != curr:
            gpu[table[curr]] = gpu[table[prev]]
        if start > 0:
            if fresh:
                self.stats.hit_mamba_states += 1
            expected = make_tag(h, start, group)
            if gpu.item(table[curr], 0) != expected:
                self._compare(req_id, f"Mamba state (group {group}) read at token {start}", [table[curr]], [0],
                              np.array([expected], dtype=np.int64), (h, group, block_size))
        gpu[table[curr]] = make_tag(h, start + num, group)

    def _forget(self, req_id: str) -> None:
        for table in (self.tables, self.mamba_state_idx, self.next_position, self.drafts, self.undelivered_drafts,
                      self.prefixes):
            table.pop(req_id, None)

    # ------------------------------------------------------------------ SimpleCPU transfers
    def issue(self, kind: str, event: int, meta: Any, reqs: Iterable[str] = ()) -> None:
        """A transfer the worker was handed this step; its bytes move when it completes."""
        torch = self.torch
        if self.cpu is None:
            return
        if kind == "load":
            src_ids, dst_ids = meta.load_cpu_blocks, meta.load_gpu_blocks
            src_tier = self.cpu
        else:
            src_ids, dst_ids = meta.store_gpu_blocks, meta.store_cpu_blocks
            src_tier = self.gpu
        src = torch.tensor(list(src_ids), dtype=torch.int64)
        dst = torch.tensor(list(dst_ids), dtype=torch.int64)
        transfer = _Transfer(kind, src, dst, src_tier[src].clone(), self._step, list(reqs))
        if kind == "load":
            requests = self.engine.scheduler.requests
            outcomes = self.engine.outcomes
            for req_id in transfer.reqs:
                if req_id in requests:
                    total = requests[req_id].num_computed_tokens
                    external = outcomes[req_id].external_tokens if req_id in outcomes else 0
                    transfer.hits[req_id] = (total - external, total)
        self.transfers[(kind, event)] = transfer

    def complete(self, key: tuple[str, int], failed: bool = False) -> None:
        """Move a transfer's bytes (``key``: its kind and event index); a failed load poisons."""
        transfer = self.transfers.pop(key, None)
        if transfer is None or transfer.done:
            return
        transfer.done = True
        src_tier, dst_tier = (self.cpu, self.gpu) if transfer.kind == "load" else (self.gpu, self.cpu)
        if failed:
            self.stats.failed_loads += 1
            dst_tier[transfer.dst] = POISONED
            return
        now = src_tier[transfer.src]
        changed = (now != transfer.snapshot).any(dim=1).nonzero().flatten().tolist()
        if changed:
            where = "CPU" if transfer.kind == "load" else "GPU"
            ids = [int(transfer.src[i]) for i in changed[:6]]
            self._violation(f"{transfer.kind} issued at step {transfer.step}: source {where} blocks {ids} "
                            f"changed while it was in flight")
        dst_tier[transfer.dst] = now
        if transfer.kind == "store":
            self.stats.stores += 1
            return
        self.stats.loads += 1
        self._check_load(transfer)

    def _check_load(self, transfer: _Transfer) -> None:
        loaded = set(transfer.dst.tolist())
        manager = self.engine.scheduler.kv_cache_manager
        for req_id, (local, hit) in transfer.hits.items():
            if req_id not in self.engine.scheduler.requests:
                continue  # aborted while loading: nothing reads these blocks
            h = self._hashes(req_id, hit)
            table = manager.get_block_ids(req_id)
            self.stats.loaded_tokens += hit - local
            for group, block_size in self.attention:
                per_slot = block_size // self.slots
                for index, block_id in enumerate(table[group]):
                    if block_id not in loaded or index * block_size >= hit:
                        continue
                    slots = np.arange(index * self.slots, (index + 1) * self.slots, dtype=np.int64)
                    slots = slots[slots * per_slot < hit]
                    self.stats.loaded_attention_blocks += 1
                    self._compare(req_id, f"loaded attention block {index} (group {group}, hit {hit})",
                                  [block_id] * len(slots), [int(s) % self.slots for s in slots],
                                  make_tags(h, np.minimum((slots + 1) * per_slot, hit), group))
            for group, block_size in self.mamba:
                for index, block_id in enumerate(table[group]):
                    if block_id not in loaded or block_id == 0:
                        continue
                    self.stats.loaded_mamba_states += 1
                    end = min((index + 1) * block_size, hit)
                    if index * block_size >= hit:
                        self._violation(f"{req_id}: a Mamba state loaded into position {index}, past the hit {hit}")
                        continue
                    self._compare(req_id, f"loaded Mamba state {index} (group {group}, hit {hit})",
                                  [block_id], [0], make_tags(h, np.array([end]), group), (h, group, block_size))

    # ------------------------------------------------------------------ verdict
    def check(self) -> None:
        assert not self.violations, "byte check violated (wrong KV or Mamba bytes):\n  " + "\n  ".join(self.violations)
