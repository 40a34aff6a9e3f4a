"""What a configuration pays for the Mamba states it keeps: states held, and prefill chunks.

:class:`MambaStateCounter` counts the Mamba-group blocks that carry a prefix-cache hash, in
the GPU block pool and in the SimpleCPU tier's pool. Invariants:

- a block counts when its hash names the first Mamba group (the hash key carries the group id):
  a state takes one block in each Mamba group, so this counts states;
  attention blocks and un-hashed (running, uncached) Mamba blocks never count;
- it samples after every step in which a request left the scheduler (a state is held from
  then until evicted), and once more at the segment end; ``peak`` and ``mean`` are over
  those samples, so two runs of one workload give the same numbers;
- prefill chunks of a request are the steps that scheduled it while its prompt was not yet
  all computed (the first counted from its hit), read from the engine's step records.

The counts are kept as keys change, not by scanning the pools at each sample (a long trace
samples thousands of times over ~16 k blocks): each block of a counted pool is given a
subclass of its own class (no new slot, so its layout and every behaviour stay the same)
whose ``_block_hash`` write adjusts the pool's tally. Every writer goes through that slot:
``set_block_hash``/``reset_hash``, the SimpleCPU managers that assign it directly, and the
plugin's own stores. :func:`held_by_scan` is the definition the tally equals at every
sample (``tests/test_replay_speed_paths.py`` checks it at every sample).

Bytes are not counted here: :func:`merge` sums the counts over segments and the report
multiplies by the bytes of one state of the resolved geometry.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

_SLOT = "_block_hash"


def held_by_scan(pool: Any, suffixes: tuple[bytes, ...]) -> int:
    """Blocks of ``pool`` whose prefix-cache key ends with one of ``suffixes`` (a full scan)."""
    if pool is None or not suffixes:
        return 0
    count = 0
    for block in pool.blocks:
        key = block.block_hash
        if key is not None and key.endswith(suffixes):
            count += 1
    return count


class PoolTally:
    """How many blocks of one pool hold a key ending with one of ``suffixes``, kept current.

    Built once per pool: it counts the pool as it is, then swaps each block's class for a
    counting subclass. A block already counted by another tally (a pool two counters watch)
    chains through that tally's subclass, so both stay exact.
    """

    def __init__(self, pool: Any, suffixes: tuple[bytes, ...]) -> None:
        self.suffixes = suffixes
        self.count = held_by_scan(pool, suffixes)
        if not suffixes:
            return
        subclasses: dict[type, type] = {}
        for block in pool.blocks:
            base = type(block)
            sub = subclasses.get(base)
            if sub is None:
                sub = subclasses[base] = self._counting_class(base)
            block.__class__ = sub

    def _counting_class(self, base: type) -> type:
        slot = next((k.__dict__[_SLOT] for k in base.__mro__ if _SLOT in k.__dict__), None)
        if not (hasattr(slot, "__get__") and hasattr(slot, "__set__")):
            raise TypeError(f"{base.__qualname__} has no {_SLOT} slot to count Mamba states by")
        read, write = slot.__get__, slot.__set__
        suffixes = self.suffixes
        tally = self

        def set_key(block: Any, key: Any) -> None:
            old = read(block)
            write(block, key)
            # Exactly the scan's test, on the key leaving and the key arriving.
            if old is not None and old.endswith(suffixes):
                tally.count -= 1
            if key is not None and key.endswith(suffixes):
                tally.count += 1

        # Reads go straight to the slot's C-level getter (one call more than a plain slot read).
        return type(base.__name__, (base,), {"__slots__": (), _SLOT: property(read, set_key), "__module__": __name__})


class MambaStateCounter:
    def __init__(self, engine: Any) -> None:
        from vllm.v1.kv_cache_interface import MambaSpec

        self.engine = engine
        groups = engine.kv_cache_config.kv_cache_groups
        # The hash key ends with the group id as 4 big-endian bytes (vLLM's BlockHashWithGroupId).
        # A state takes one block in every Mamba group: count it by the first group's block.
        self._suffixes = tuple(
            i.to_bytes(4, "big", signed=False) for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)
        )[:1]
        self.gpu_pool = engine.scheduler.kv_cache_manager.block_pool
        self._gpu = PoolTally(self.gpu_pool, self._suffixes)
        self._cpu: PoolTally | None = None
        self._cpu_of: Any = None  # the pool ``_cpu`` counts
        self.samples = {"gpu": [], "cpu": []}

    def _cpu_pool(self) -> Any:
        return getattr(self.engine.offload_manager, "cpu_block_pool", None)

    def _cpu_tally(self, pool: Any) -> PoolTally:
        if self._cpu_of is not pool:
            self._cpu, self._cpu_of = PoolTally(pool, self._suffixes), pool
        return self._cpu  # type: ignore[return-value]

    def held(self) -> tuple[int, int | None]:
        """(GPU, CPU) Mamba states held now; CPU is None without a CPU tier."""
        cpu = self._cpu_pool()
        return self._gpu.count, (None if cpu is None else self._cpu_tally(cpu).count)

    def sample(self) -> None:
        gpu, cpu = self.held()
        self.samples["gpu"].append(gpu)
        if cpu is not None:
            self.samples["cpu"].append(cpu)

    def after_step(self, finished: Iterable[str]) -> None:
        if any(True for _ in finished):
            self.sample()

    def counts(self, prompts: dict[str, int]) -> dict[str, Any]:
        """Peak/mean/final states per tier and prefill chunks of the requests in ``prompts``."""
        self.sample()  # the segment end
        out: dict[str, Any] = {}
        for tier, values in self.samples.items():
            if tier == "cpu" and self._cpu_pool() is None:
                continue
            out[tier] = {"peak": max(values), "sum": sum(values), "samples": len(values), "final": values[-1]}
        out["prefill_chunks"] = prefill_chunks(self.engine.steps, prompts)
        out["requests"] = len(prompts)
        return out


def prefill_chunks(steps: Iterable[Any], prompts: dict[str, int]) -> int:
    """Steps that scheduled a request of ``prompts`` while its prompt was not all computed."""
    computed: dict[str, int] = {}
    chunks = 0
    for step in steps:
        for rid, first in step.first_scheduled.items():
            if rid in prompts:
                computed[rid] = first
        for rid, tokens in step.num_scheduled_tokens.items():
            done = computed.get(rid)
            if done is None or rid not in prompts:
                continue
            if done < prompts[rid]:
                chunks += 1
            computed[rid] = done + tokens
    return chunks


def merge(parts: Iterable[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The counts of a whole run: peaks are the largest segment's, means over all samples."""
    parts = list(parts)
    if not parts or any(p is None for p in parts):
        return None
    out: dict[str, Any] = {}
    for tier in ("gpu", "cpu"):
        rows = [p[tier] for p in parts if tier in p]
        if not rows:
            continue
        samples = sum(r["samples"] for r in rows)
        out[tier] = {
            "peak": max(r["peak"] for r in rows),
            "mean": round(sum(r["sum"] for r in rows) / samples, 1) if samples else 0.0,
            "final": rows[-1]["final"],
        }
    requests = sum(p["requests"] for p in parts)
    chunks = sum(p["prefill_chunks"] for p in parts)
    out["prefill_chunks"] = chunks
    out["prefill_chunks_per_request"] = round(chunks / requests, 3) if requests else 0.0
    return out
