"""Plain helpers shared by the test modules (fixtures live in ``conftest.py``)."""

from __future__ import annotations

import contextlib
import logging
import os
import random
from collections.abc import Iterator
from pathlib import Path

from hybrid_kv_plugin.adapters import Support
from hybrid_kv_plugin.sim.workload import Segment, TraceRequest

N, B, U = Support.NATIVE, Support.BACKPORT, Support.UNAVAILABLE
# (fine-grained CPU hits, junction checkpoint, NIXL slot pairing) per supported wheel.
CAPABILITY_TABLE = {
    "0.26.0": (B, B, B),
    "0.27.1": (B, B, N),
    "0.28.0": (B, B, N),
    "0.29.0": (B, B, N),
    "0.30.0": (N, N, N),
    "0.31.0": (N, N, N),
    "0.32.0": (N, N, N),
    "0.33.0": (N, N, N),
}

# Deterministic "prompt" tokens; any ids below the tiny model's vocab work.
BASE_TOKENS = [(i * 37) % 1000 + 1 for i in range(1, 5000)]


def tokens(n: int, offset: int = 0) -> list[int]:
    return BASE_TOKENS[offset : offset + n]


def small_workload() -> list[Segment]:
    """The small fixed workload of the replay and bench tests.

    Ten requests; no prompt ends on a hash boundary (where wheels place the tail
    checkpoint differently: 0.30-0.31 at the prompt end, 0.32+ one unit lower)."""
    rng = random.Random(7)

    def fresh(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(1, 1000) for _ in range(n))

    c0 = fresh(300)
    c1 = fresh(203)
    c0_t1 = c0 + (7,) * 4 + fresh(37)
    c1_t1 = c1 + (7,) * 2 + fresh(45)
    c0_t2 = c0_t1 + (7,) * 2 + fresh(21)
    chat = (
        TraceRequest("c0-t0", 0, c0, 4),
        TraceRequest("c1-t0", 0, c1, 2),
        TraceRequest("c0-t1", 1, c0_t1, 2, evict_gpu_before=True),
        TraceRequest("c1-t1", 1, c1_t1, 2, evict_gpu_before=True),
        TraceRequest("c0-t2", 2, c0_t2, 2),
    )
    system = fresh(260)
    agents = (
        TraceRequest("root", 0, system + fresh(45), 4),
        TraceRequest("s0", 1, system + fresh(23), 2),
        TraceRequest("s1", 2, system + fresh(37), 2),
        TraceRequest("s2", 3, system + fresh(53), 2, evict_gpu_before=True),
        TraceRequest("s3", 3, system + fresh(67), 2),
    )
    return [Segment("chat", chat, eagle=False), Segment("agents", agents, eagle=True)]


# small_workload measured on stock vLLM 0.33.0: the reference every wheel with fine-grained CPU hits must match.
V033_STOCK = {
    "ideal_tokens": 1856,
    "reused_gpu_tokens": 320,
    "reused_cpu_tokens": 496,
    "loss": {"no_mamba_state": 976, "eagle_prune": 64},
}
# 0.26-0.27 keep a Mamba state at every whole 64-token block on the GPU, so the backport there
# reuses more than the 0.33 reference. (plugin summary, plugin+junction summary, hand-off tokens
# the plugin leaves unserved on the small / default workload (plugin, plugin+junction)).
KEEPS_EVERY_BLOCK = {
    "0.26.0": (
        {"ideal_tokens": 1856, "reused_gpu_tokens": 720, "reused_cpu_tokens": 864,
         "loss": {"no_mamba_state": 208, "eagle_prune": 64}},
        {"ideal_tokens": 1856, "reused_gpu_tokens": 720, "reused_cpu_tokens": 1056,
         "loss": {"no_mamba_state": 64, "eagle_prune": 16}},
        0, (0, 0),
    ),
    "0.27.1": (
        {"ideal_tokens": 1856, "reused_gpu_tokens": 704, "reused_cpu_tokens": 880,
         "loss": {"no_mamba_state": 208, "eagle_prune": 64}},
        {"ideal_tokens": 1856, "reused_gpu_tokens": 704, "reused_cpu_tokens": 1024,
         "loss": {"no_mamba_state": 64, "eagle_prune": 64}},
        0, (0, 0),
    ),
}
# Scheduler steps of (stock, plugin, plugin+junction) where the plugin runs.
STEPS = {
    "0.26.0": (38, 38, 42),
    "0.27.1": (38, 38, 44),
    "0.28.0": (40, 40, 39),
    "0.29.0": (40, 40, 39),
    "0.30.0": (36, 36, 35),
    "0.31.0": (36, 36, 35),
    "0.32.0": (36, 36, 35),
    "0.33.0": (36, 36, 35),
}


class LogRecords(logging.Handler):
    """Every record a logger (and its children) hands this handler."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, level: int = logging.DEBUG) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= level]


@contextlib.contextmanager
def recording(logger_name: str, level: int | None = None) -> Iterator[LogRecords]:
    """Records of ``logger_name`` while inside, whatever vLLM's propagation; ``level``: the
    logger's level meanwhile (None: unchanged)."""
    logger, handler = logging.getLogger(logger_name), LogRecords()
    old_level = logger.level
    logger.addHandler(handler)
    if level is not None:
        logger.setLevel(level)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def alive(pid: int) -> bool:
    """A process with this PID runs (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for every purpose here (its parent reaps it on wait()).
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def record_admission_counts(engine) -> dict[str, list[int]]:
    """Per request, the Mamba group's counts in vLLM's admission checks (``apply_admission_cap``), as they
    happen. Binds an observer on the engine's one Mamba manager; it records the real count, changes nothing."""
    (mamba,) = [m for m in engine.scheduler.kv_cache_manager.coordinator.single_type_managers if "Mamba" in type(m).__name__]
    counts: dict[str, list[int]] = {}
    count = mamba.get_num_blocks_to_allocate

    def observed(request_id, *args, **kwargs):
        result = count(request_id, *args, **kwargs)
        if kwargs.get("apply_admission_cap", args[-1] if len(args) == 6 else False):
            counts.setdefault(request_id, []).append(result)
        return result

    mamba.get_num_blocks_to_allocate = observed
    return counts
