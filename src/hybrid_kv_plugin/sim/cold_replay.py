"""Cold -> replay: every request of a workload twice, the GPU prefix cache evicted in between.

The upstream figure of merit for fine-grained CPU hits ("replay external hit"):
tokens of the second pass served from the CPU tier over the second pass's prompt
tokens. Retries, regenerations, evaluation reruns and agent re-plays are such
exact replays; with the GPU cache gone, only the CPU tier can serve them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from hybrid_kv_plugin.sim.workload import Segment

REPLAY_PREFIX = "replay:"


def cold_replay_segments(segments: Sequence[Segment]) -> list[Segment]:
    """Each segment followed by its own exact replay: same prompts and waves, new ids, GPU evicted first."""
    out = []
    for segment in segments:
        last_wave = max((r.wave for r in segment.requests), default=-1)
        first_wave = min((r.wave for r in segment.requests), default=0)
        second = tuple(
            replace(
                r,
                request_id=REPLAY_PREFIX + r.request_id,
                wave=last_wave + 1 + r.wave - first_wave,
                evict_gpu_before=r.wave == first_wave or r.evict_gpu_before,
            )
            for r in segment.requests
        )
        out.append(replace(segment, requests=(*segment.requests, *second)))
    return out


def replay_external_hit(result: Any) -> dict[str, Any] | None:
    """CPU-tier hit tokens / prompt tokens of the replay pass of one ``ReplayResult`` (None if refused)."""
    if result.refused is not None:
        return None
    rows = [
        row for segment in result.segments for rid, row in segment.per_request.items() if rid.startswith(REPLAY_PREFIX)
    ]
    prompt = sum(row["prompt"] for row in rows)
    cpu = sum(row["cpu"] for row in rows)
    return {"cpu_tokens": cpu, "prompt_tokens": prompt, "ratio": round(cpu / prompt, 4) if prompt else 0.0}
