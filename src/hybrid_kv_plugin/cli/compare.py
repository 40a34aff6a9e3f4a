"""``hybrid-kv replay --compare``: saved ``replay --json`` reports side by side, one column
group per report (wheel), one column per configuration."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, TextIO

from hybrid_kv_plugin.cli.errors import fail


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}"


_COMPARE_ROWS = (
    ("ideal tokens", lambda r: r["ideal_tokens"]),
    ("reused from GPU", lambda r: r["reused_gpu_tokens"]),
    ("reused from CPU", lambda r: r["reused_cpu_tokens"]),
    ("efficiency", lambda r: f"{r['efficiency']:.3f}"),
    ("reused / reachable", lambda r: _fmt(r.get("efficiency_of_reachable"))),
    ("scheduler steps", lambda r: r["steps"]),
    # Mamba states kept (peak / mean cached state blocks); "-" in reports saved before they were counted.
    ("Mamba states GPU peak/mean", lambda r: _states(r, "gpu")),
    ("Mamba states CPU peak/mean", lambda r: _states(r, "cpu")),
    ("prefill chunks / request", lambda r: (r.get("mamba_states") or {}).get("prefill_chunks_per_request", "-")),
)

_STATE_ROWS = {label for label, _ in _COMPARE_ROWS[-3:]}


def _states(row: dict, tier: str) -> str:
    counts = (row.get("mamba_states") or {}).get(tier)
    return "-" if counts is None else f"{counts['peak']}/{counts['mean']:g}"


def render_comparison(paths: Sequence[str], out: TextIO) -> int:
    from hybrid_kv_plugin.sim.attribution import Bucket

    reports = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as handle:
                reports.append(json.load(handle))
        except (OSError, ValueError) as exc:
            fail(f"--compare {path}: {exc}")
    columns = [(f"vLLM {report['vllm']}", r["name"], r) for report in reports for r in report["results"]]
    cell = max(10, *(len(name) for _, name, _ in columns)) + 1
    groups: list[tuple[str, int]] = []
    for wheel, _, _ in columns:
        if groups and groups[-1][0] == wheel:
            groups[-1] = (wheel, groups[-1][1] + 1)
        else:
            groups.append((wheel, 1))
    rows = list(_COMPARE_ROWS) + [
        (f"lost: {b.label}", lambda r, b=b: (r.get("loss") or {}).get(b.value, "-")) for b in Bucket
    ]
    width = max(len(label) for label, _ in rows) + 1
    lines = [
        " " * width + "".join(f" | {g:<{n * cell - 1}}" for g, n in groups),
        " " * width + _grouped([name for _, name, _ in columns], groups, cell),
    ]
    for label, get in rows:
        values = [("refused" if "refused" in r else get(r)) for _, _, r in columns]
        if label.startswith("lost: ") and all(v in (0, "-", "refused") for v in values):
            continue
        if label in _STATE_ROWS and all(v in ("-", "refused") for v in values):
            continue
        lines.append(f"{label:<{width}}" + _grouped([str(v) for v in values], groups, cell))
    out.write("".join(line.rstrip() + "\n" for line in lines))
    return 0


def _grouped(values: list[str], groups: list[tuple[str, int]], cell: int) -> str:
    text, i = "", 0
    for _, n in groups:
        text += " |" + "".join(f"{v:>{cell}}" for v in values[i : i + n])
        i += n
    return text
