"""Test-only: run vLLM 0.32's SimpleCPU offload worker on a CPU-only machine.

Why: the worker side of ``SimpleCPUOffloadConnector`` in vLLM 0.32.0 assumes CUDA in
exactly these places (``vllm/v1/simple_kv_offload/``):

- ``worker.py:165``  ``torch.cuda.Stream.priority_range()`` (the CPU runner's stream
  placeholder has no such method: ``AttributeError`` at start-up), and ``worker.py:166-167``
  ``torch.cuda.Stream(priority=...)``;
- ``worker.py:286-287`` ``torch.Event()`` recorded on ``torch.cuda.current_stream()``
  before each store;
- ``worker.py:352/357/367`` ``event.synchronize()`` / ``event.query()`` on the copy events;
- ``worker.py:237`` ``DmaCopyBackend()`` -> ``copy_backend.py:50-59`` ``build_params`` and
  ``copy_backend.py:127`` ``copy_blocks`` (``cuda_mem_ops.py``: ``cuMemcpyBatchAsync``
  found through ``cuGetProcAddress`` at line 125), run on a background thread.

What this changes, in the ``worker`` module only (never the global ``torch``): its
``torch`` name sees a stand-in ``cuda.Stream`` / ``cuda.current_stream`` / ``Event``, and
its ``DmaCopyBackend`` name is :class:`SynchronousCopyBackend`, a plain per-tensor
``index_select`` + ``index_copy_`` done before ``launch_copy`` returns, whose events
report done. Everything else -- block bookkeeping, the region views built from the KV
cache tensors, the scheduler side, the hybrid-kv-plugin's patches -- is vLLM's and the
plugin's real code. This copy path is the one piece the CPU engine test does not exercise.

``LOAD_FAULT``: a test may set it to a callable ``(cpu_blocks, gpu_blocks) -> cpu_blocks``
to make loads read deliberately wrong CPU blocks (the mutation check of the engine test).
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable

import torch

logger = logging.getLogger("vllm.hybrid_kv_test_copy_standin")

# Set by a test (single-process engine) to corrupt loads on purpose; None = faithful copies.
LOAD_FAULT: Callable[[list[int], list[int]], list[int]] | None = None
# (cpu_blocks, gpu_blocks) of every load, in order: lets a test see what was loaded.
LOADS: list[tuple[list[int], list[int]]] = []


class _DoneEvent:
    """Copies are synchronous, so every event is complete when it is created."""

    def record(self, *args, **kwargs) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _CpuStream:
    def __init__(self, *args, **kwargs) -> None:
        self.device = torch.device("cpu")

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return 0, 0

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _WorkerTorch(types.ModuleType):
    """``torch`` as the worker module sees it: everything real except the CUDA stream/event API."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = types.SimpleNamespace(Stream=_CpuStream, current_stream=lambda *a, **k: _CpuStream())
        self.Event = _DoneEvent

    def __getattr__(self, name: str):
        return getattr(torch, name)


class SynchronousCopyBackend:
    """Same calls as vLLM's ``DmaCopyBackend``; copies whole blocks of every cache region in place."""

    def init(self, gpu_caches, cpu_caches, device, load_stream, store_stream) -> None:
        self._pairs = [(gpu_caches[name], cpu_caches[name]) for name in gpu_caches]

    def launch_copy(self, src_blocks, dst_blocks, is_store, event_idx, events_list, wait_event=None) -> None:
        src_blocks, dst_blocks = list(src_blocks), list(dst_blocks)
        if not is_store:
            if LOAD_FAULT is not None:
                src_blocks = list(LOAD_FAULT(src_blocks, dst_blocks))
            LOADS.append((src_blocks, dst_blocks))
        src_index = torch.tensor(src_blocks, dtype=torch.long)
        dst_index = torch.tensor(dst_blocks, dtype=torch.long)
        for gpu, cpu in self._pairs:
            src, dst = (gpu, cpu) if is_store else (cpu, gpu)
            dst.index_copy_(0, dst_index, src.index_select(0, src_index))
        events_list.append((event_idx, _DoneEvent()))

    def shutdown(self) -> None:
        pass


_installed = False


def install() -> None:
    """vLLM general-plugin entry point: runs in every vLLM process, idempotent."""
    global _installed
    if _installed:
        return
    from vllm.v1.simple_kv_offload import worker

    worker.torch = _WorkerTorch()
    worker.DmaCopyBackend = SynchronousCopyBackend
    _installed = True
    logger.info("hybrid-kv test stand-in: SimpleCPU offload worker copies are synchronous CPU copies")
