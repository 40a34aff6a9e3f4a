"""What a configuration pays for the Mamba states it keeps: states held, and prefill chunks.

:class:`MambaStateCounter` counts the Mamba-group blocks that carry a prefix-cache hash, in
the GPU block pool and in the SimpleCPU tier's pool, read-only. Invariants:

- a block counts when its hash names a Mamba group (the hash key carries the group id);
  attention blocks and un-hashed (running, uncached) Mamba blocks never count;
- it samples after every step in which a request left the scheduler (a state is held from
  then until evicted), and once more at the segment end; ``peak`` and ``mean`` are over
  those samples, so two runs of one workload give the same numbers;
- prefill chunks of a request are the steps that scheduled it while its prompt was not yet
  all computed (the first counted from its hit), read from the engine's step records.

Bytes are not counted here: :func:`merge` sums the counts over segments and the report
multiplies by the bytes of one state of the resolved geometry.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class MambaStateCounter:
    def __init__(self, engine: Any) -> None:
        from vllm.v1.kv_cache_interface import MambaSpec

        self.engine = engine
        groups = engine.kv_cache_config.kv_cache_groups
        # The hash key ends with the group id as 4 big-endian bytes (vLLM's BlockHashWithGroupId).
        self._suffixes = tuple(
            i.to_bytes(4, "big", signed=False) for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)
        )
        self.gpu_pool = engine.scheduler.kv_cache_manager.block_pool
        self.samples = {"gpu": [], "cpu": []}

    def _cpu_pool(self) -> Any:
        return getattr(self.engine.offload_manager, "cpu_block_pool", None)

    def _held(self, pool: Any) -> int:
        if pool is None or not self._suffixes:
            return 0
        suffixes = self._suffixes
        count = 0
        for block in pool.blocks:
            key = block.block_hash
            if key is not None and key.endswith(suffixes):
                count += 1
        return count

    def sample(self) -> None:
        self.samples["gpu"].append(self._held(self.gpu_pool))
        cpu = self._cpu_pool()
        if cpu is not None:
            self.samples["cpu"].append(self._held(cpu))

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
