"""The small fixed workload of the replay and bench tests (no tests here; shared by both)."""

from __future__ import annotations

import random

from hybrid_kv_plugin.sim.workload import Segment, TraceRequest


def small_workload() -> list[Segment]:
    """Ten requests; no prompt ends on a hash boundary (where wheels place the tail checkpoint
    differently: 0.30-0.31 at the prompt end, 0.32+ one unit lower)."""
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
