"""``hybrid-kv replay``: what a workload would reuse on this wheel, stock vs plugin, on a CPU.

Also home of what ``bench`` shares with it: the geometry flags, the progress bar, and
the workload selection.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

CONFIG_NAMES = (
    "stock", "plugin", "plugin+junction", "plugin+tail-replay", "plugin+tail-both", "plugin+output-checkpoint",
)
COLD_REPLAY_CONFIGS = ("stock", "plugin", "plugin+tail-replay", "plugin+tail-both")


# ---------------------------------------------------------------------------- shared with bench
def add_geometry_arguments(parser: argparse.ArgumentParser) -> None:
    from hybrid_kv_plugin.sim.replay import ReplaySettings as default

    g = parser.add_argument_group("geometry and pools")
    g.add_argument(
        "--attention-block-size", type=int, default=default.attention_block_size, metavar="N",
        help="full-attention block (tokens)",
    )
    g.add_argument(
        "--mamba-block-size", type=int, default=default.mamba_block_size, metavar="N", help="Mamba block (tokens)"
    )
    g.add_argument(
        "--prefix-match-unit", dest="hash_block_size", type=int, default=default.hash_block_size, metavar="N",
        help="hash unit of prefix matching",
    )
    g.add_argument("--gpu-blocks", type=int, default=default.gpu_blocks, metavar="N", help="GPU KV-cache blocks")
    g.add_argument(
        "--cpu-blocks", type=int, default=default.cpu_blocks, metavar="N", help="CPU-tier blocks (SimpleCPU pool)"
    )
    eagle = g.add_mutually_exclusive_group()
    eagle.add_argument("--eagle", dest="eagle", action="store_true", default=None, help="EAGLE on in every segment")
    eagle.add_argument("--no-eagle", dest="eagle", action="store_false", help="EAGLE off in every segment")
    g.add_argument("--num-speculative-tokens", type=int, default=default.num_speculative_tokens, metavar="N")
    g.add_argument(
        "--transfer-delay-steps", type=int, default=default.transfer_delay_steps, metavar="N",
        help="steps the simulated worker takes to finish a CPU transfer (in-flight stores hold CPU blocks)",
    )


# ReplaySettings field -> the flag that sets it.
SETTINGS_FLAGS = {
    "attention_block_size": "--attention-block-size",
    "mamba_block_size": "--mamba-block-size",
    "hash_block_size": "--prefix-match-unit",
    "gpu_blocks": "--gpu-blocks",
    "cpu_blocks": "--cpu-blocks",
    "num_speculative_tokens": "--num-speculative-tokens",
    "transfer_delay_steps": "--transfer-delay-steps",
}


def settings_from(args: argparse.Namespace) -> Any:
    from hybrid_kv_plugin.sim.replay import ReplaySettings

    for name, flag in SETTINGS_FLAGS.items():
        if getattr(args, name) < (0 if name == "transfer_delay_steps" else 1):
            raise SystemExit(f"hybrid-kv: {flag} must be a positive integer")
    return ReplaySettings(**{name: getattr(args, name) for name in SETTINGS_FLAGS})


class Progress:
    """Progress on stderr: a redrawn bar with an ETA on a terminal; elsewhere (``lines=True``)
    one line per 10 % of the requests, so a log file stays readable."""

    def __init__(
        self,
        total: int,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        lines: bool = False,
        clock: Any = None,
    ) -> None:
        import time

        self.stream = stream or sys.stderr
        self.total = max(total, 1)
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.lines = lines and not self.enabled
        self.clock = clock or time.monotonic
        self.started = self.clock()
        self.base = 0
        self.label = ""
        self.next_tenth = 1

    def start(self, label: str) -> None:
        self.label = label

    def _eta(self, done: int) -> str:
        elapsed = self.clock() - self.started
        if done <= 0:
            return f"{elapsed:.0f}s elapsed"
        left = elapsed * (self.total - done) / done
        return f"{elapsed:.0f}s elapsed, ETA {left:.0f}s"

    def update(self, done_in_run: int) -> None:
        done = self.base + done_in_run
        if self.lines:
            while self.next_tenth <= 10 and done * 10 >= self.next_tenth * self.total:
                self.stream.write(f"{self.label}: {done}/{self.total} requests ({self.next_tenth * 10}%), {self._eta(done)}\n")
                self.next_tenth += 1
            self.stream.flush()
            return
        if not self.enabled:
            return
        width = 30
        filled = width * done // self.total
        self.stream.write(
            f"\r{self.label:<16} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} requests, {self._eta(done)}"
        )
        self.stream.flush()

    def finish_run(self, requests: int) -> None:
        self.base += requests

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()


# ---------------------------------------------------------------------------- replay command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", metavar="FILE.jsonl", help="JSONL trace (see README); default: the embedded workload")
    parser.add_argument("--seed", type=int, default=0, help="seed of the embedded workload")
    parser.add_argument("--scale", type=int, default=1, help="size multiplier of the embedded workload (31 requests each)")
    parser.add_argument(
        "--configs",
        default=None,
        help=f"comma-separated, from {', '.join(CONFIG_NAMES)}; plugin+junction is the plugin with the "
        "mamba_shared_prefix_checkpoint switch on, plugin+tail-X the plugin with prompt_tail_checkpoint X, "
        "plugin+output-checkpoint the plugin with mamba_output_checkpoint on "
        "(default: stock,plugin, plus plugin+junction when a segment runs EAGLE; with --cold-replay: "
        f"{','.join(COLD_REPLAY_CONFIGS)})",
    )
    parser.add_argument(
        "--cold-replay",
        action="store_true",
        help="run every request twice, the GPU prefix cache evicted in between, and report the replay "
        "external hit (CPU-tier hit tokens / prompt tokens of the second pass) per configuration",
    )
    add_geometry_arguments(parser)
    from hybrid_kv_plugin.cli import replay_inputs

    replay_inputs.add_arguments(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="machine-readable output")
    out.add_argument("--per-request", action="store_true", help="with --json: every request's ideal, reuse and loss")
    out.add_argument("--plot", metavar="FILE.png", help="bar chart of reused vs ideal per configuration (needs matplotlib)")
    out.add_argument(
        "--compare",
        nargs="+",
        metavar="REPORT.json",
        help="render saved `replay --json` reports side by side (one per wheel) and exit; runs nothing",
    )


def load_segments(args: argparse.Namespace) -> list[Any]:
    from hybrid_kv_plugin.sim.workload import default_workload, with_eagle

    if args.trace:
        from hybrid_kv_plugin.cli.replay_inputs import InputError, load_trace_file

        try:
            segments = load_trace_file(args)
        except InputError as exc:
            raise SystemExit(str(exc)) from None
    else:
        if args.scale < 1:
            raise SystemExit("hybrid-kv: --scale must be >= 1")
        segments = default_workload(seed=args.seed, scale=args.scale)
    segments = with_eagle(segments, args.eagle)
    if getattr(args, "cold_replay", False):
        from hybrid_kv_plugin.sim.cold_replay import cold_replay_segments

        segments = cold_replay_segments(segments)
    return segments


def choose_configs(names: str | None, segments: Sequence[Any], cold_replay: bool = False) -> list[Any]:
    from hybrid_kv_plugin.sim.replay import CONFIGS

    if names is None and cold_replay:
        chosen = list(COLD_REPLAY_CONFIGS)
    elif names is None:
        chosen = ["stock", "plugin"]
        if any(s.eagle for s in segments):
            chosen.append("plugin+junction")
    else:
        chosen = [n.strip() for n in names.split(",") if n.strip()]
        unknown = [n for n in chosen if n not in CONFIGS]
        if unknown or not chosen:
            raise SystemExit(f"hybrid-kv: --configs {names!r}: allowed: {', '.join(CONFIG_NAMES)}")
    return [CONFIGS[n] for n in chosen]


def run_replay_command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    if args.compare:
        return render_comparison(args.compare, out)
    from hybrid_kv_plugin.cli.replay_inputs import InputError, check_flags, check_lengths, resolve_model

    try:
        check_flags(args)
    except InputError as exc:
        raise SystemExit(str(exc)) from None
    if args.plot:
        _require_matplotlib()
    segments = load_segments(args)
    settings = settings_from(args)
    configs = choose_configs(args.configs, segments, cold_replay=args.cold_replay)
    try:
        model = resolve_model(args)
        if model is not None:
            settings = settings_for_model(settings, model, args)
        check_lengths(segments, settings.max_model_len or DEFAULT_MAX_MODEL_LEN)
    except InputError as exc:
        raise SystemExit(str(exc)) from None
    from hybrid_kv_plugin.sim.replay import replay

    total = sum(len(s.requests) for s in segments)
    progress = Progress(total * len(configs), lines=True)
    results, timings = [], []
    # --cold-replay sums the replay pass from the full per-request rows.
    rows = args.per_request or args.cold_replay
    for config in configs:
        progress.start(config.name)
        # No StepTimer here: its process-CPU clock costs a system call per step (up to a third of
        # a long replay's time on a busy machine); steps/s is steps over wall time.
        started = _wall()
        results.append(replay(segments, settings, config, progress=progress.update, per_request=rows))
        timings.append(_timing(_wall() - started, total, results[-1].steps))
        progress.finish_run(total)
    progress.close()
    report = build_report(segments, settings, results, per_request=args.per_request)
    for row, timing in zip(report["results"], timings):
        row["timing"] = timing
    if model is not None:
        report["model_geometry"] = model.as_dict()
    if args.cold_replay:
        from hybrid_kv_plugin.sim.cold_replay import replay_external_hit

        for summary, result in zip(report["results"], results):
            summary["replay_external_hit"] = replay_external_hit(result)
    if args.plot:
        plot_report(report, args.plot)
    if args.json:
        out.write(json.dumps(report, indent=2) + "\n")
    else:
        render_report(report, out)
        if args.plot:
            out.write(f"\nplot written to {args.plot}\n")
    return 0


# The shipped tiny model's max_position_embeddings: the ceiling without --model.
DEFAULT_MAX_MODEL_LEN = 262144


def _wall() -> float:
    import time

    return time.monotonic()


def _timing(seconds: float, requests: int, steps: int) -> dict[str, Any]:
    """Wall time, throughput and peak RSS of one configuration's run (this process so far)."""
    import resource

    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "wall_s": round(seconds, 1),
        "requests_per_s": round(requests / seconds, 2) if seconds else None,
        "steps_per_s": round(steps / seconds, 1) if seconds else None,
        "peak_rss_mib": round(peak_kib / 1024),
    }


def settings_for_model(settings: Any, model: Any, args: argparse.Namespace) -> Any:
    """The replay settings of a resolved model: its block sizes, unit, length and pools.

    Explicit geometry flags would contradict the model, so they are refused.
    """
    from dataclasses import replace

    from hybrid_kv_plugin.cli.replay_inputs import fail

    from hybrid_kv_plugin.sim.replay import ReplaySettings

    given = [SETTINGS_FLAGS[n] for n in MODEL_GEOMETRY_FIELDS if getattr(args, n) != getattr(ReplaySettings, n)]
    if given:
        fail(f"{', '.join(given)} conflict(s) with the model's resolved geometry; put cache flags in the serve line after --")
    return replace(
        settings,
        attention_block_size=model.attention_block_size,
        mamba_block_size=model.mamba_block_size,
        hash_block_size=model.hash_block_size,
        mamba_cache_mode=model.mamba_cache_mode,
        gpu_blocks=model.gpu_blocks,
        cpu_blocks=model.cpu_blocks,
        max_model_len=model.max_model_len,
        max_num_batched_tokens=model.max_num_batched_tokens,
        max_num_seqs=model.max_num_seqs,
    )


# The settings a resolved model decides; a flag that sets one of them contradicts the model.
MODEL_GEOMETRY_FIELDS = ("attention_block_size", "mamba_block_size", "hash_block_size", "gpu_blocks", "cpu_blocks")


def build_report(segments: Sequence[Any], settings: Any, results: Sequence[Any], per_request: bool = False) -> dict:
    from dataclasses import asdict

    from hybrid_kv_plugin import __version__
    from hybrid_kv_plugin.registration import current_adapter

    return {
        "vllm": current_adapter().version,
        "plugin": __version__,
        "settings": asdict(settings),
        "segments": [{"name": s.name, "requests": len(s.requests), "eagle": bool(s.eagle)} for s in segments],
        "results": [r.as_dict(per_request=per_request) for r in results],
    }


# ---------------------------------------------------------------------------- rendering
def render_report(report: dict, out: TextIO) -> None:
    from hybrid_kv_plugin.sim.attribution import Bucket

    w = out.write
    s = report["settings"]
    segs = ", ".join(f"{x['name']} {x['requests']}{' with EAGLE' if x['eagle'] else ''}" for x in report["segments"])
    requests = sum(x["requests"] for x in report["segments"])
    w(f"hybrid-kv replay on vLLM {report['vllm']}: {requests} requests ({segs})\n")
    model = report.get("model_geometry")
    if model is not None:
        from hybrid_kv_plugin.sim.model_geometry import ModelGeometry, describe

        w(f"geometry: {describe(ModelGeometry(**model))}\n\n")
    else:
        w(
            f"geometry: FA {s['attention_block_size']} / Mamba {s['mamba_block_size']} {s['mamba_cache_mode']} / "
            f"prefix-match unit {s['hash_block_size']}; GPU {s['gpu_blocks']} blocks, CPU {s['cpu_blocks']} blocks\n\n"
        )
    results = report["results"]
    header = ("config", "prompt tok", "ideal", "reused", "from GPU", "from CPU", "lost", "efficiency", "steps")
    w("{:<18} {:>10} {:>7} {:>7} {:>9} {:>9} {:>6} {:>10} {:>6}\n".format(*header))
    for r in results:
        if "refused" in r:
            w(f"{r['name']:<18} refused: {r['refused']}\n")
            continue
        w(
            f"{r['name']:<18} {r['prompt_tokens']:>10} {r['ideal_tokens']:>7} {r['reused_tokens']:>7} "
            f"{r['reused_gpu_tokens']:>9} {r['reused_cpu_tokens']:>9} {r['lost_tokens']:>6} "
            f"{r['efficiency']:>10.3f} {r['steps']:>6}\n"
        )
    ran = [r for r in results if "refused" not in r]
    if not ran:
        return
    names = [r["name"] for r in ran]
    width = max(16, *(len(n) + 1 for n in names))
    row = "{:<32}" + "".join(f" {{:>{width}}}" for _ in names) + "\n"
    w("\n" + " " * 32 + "".join(f" {n:>{width}}" for n in names) + "\n")
    w(row.format("hits from the GPU cache", *(f"{_share(r['reused_gpu_tokens'], r['prompt_tokens'])}" for r in ran)))
    w(row.format("hits from the CPU tier", *(f"{_share(r['reused_cpu_tokens'], r['prompt_tokens'])}" for r in ran)))
    w("  (share of all prompt tokens)\n")
    if all("ttft_steps" in r for r in ran):
        w(row.format("TTFT steps mean / p90", *(f"{r['ttft_steps']['mean']:.1f} / {r['ttft_steps']['p90']}" for r in ran)))
    if all("timing" in r for r in ran):
        w(row.format("wall s", *(r["timing"]["wall_s"] for r in ran)))
        w(row.format("requests/s", *(r["timing"]["requests_per_s"] for r in ran)))
        w(row.format("scheduler steps/s", *(r["timing"]["steps_per_s"] for r in ran)))
        w(row.format("peak RSS MiB (process)", *(r["timing"]["peak_rss_mib"] for r in ran)))
    if len(report["segments"]) > 1:
        w("\nefficiency by segment\n")
        for i, seg in enumerate(report["segments"]):
            label = f"  {seg['name']}{' (EAGLE)' if seg['eagle'] else ''}"
            w(row.format(label, *(f"{r['segments'][i]['efficiency']:.3f}" for r in ran)))
    if all(r["loss"] is not None for r in ran):
        w("\nloss attribution (tokens)" + " " * 7 + "".join(f" {n:>{width}}" for n in names) + "\n")
        for bucket in Bucket:
            values = [r["loss"][bucket.value] for r in ran]
            if bucket is Bucket.UNEXPLAINED and not any(values):
                continue
            w(row.format(f"  {bucket.label}", *values))
        w(row.format("  total lost", *(r["lost_tokens"] for r in ran)))
        w(row.format("reused / reachable", *(f"{r['efficiency_of_reachable']:.3f}" for r in ran)))
        w("  (reachable = ideal - no Mamba state - EAGLE prune: what a cache could have served)\n")
    if any(r.get("replay_external_hit") for r in ran):
        w("\nreplay external hit (cold -> replay: CPU-tier hit tokens / prompt tokens of the second pass)\n")
        hits = [r["replay_external_hit"] for r in ran]
        w(row.format("  CPU-tier hit tokens", *(h["cpu_tokens"] for h in hits)))
        w(row.format("  replay prompt tokens", *(h["prompt_tokens"] for h in hits)))
        w(row.format("  replay external hit", *(f"{h['ratio']:.4f}" for h in hits)))
    if any(r["boundary_stats"] is not None for r in ran):
        w("\nboundary hand-offs (connector counters; - = the connector has none)\n")
        from hybrid_kv_plugin.sim.replay import STORE_FIELDS

        for field in STORE_FIELDS:
            values = [r["boundary_stats"][field] if r["boundary_stats"] is not None else "-" for r in ran]
            w(row.format(f"  {field}", *values))


_COMPARE_ROWS = (
    ("ideal tokens", lambda r: r["ideal_tokens"]),
    ("reused from GPU", lambda r: r["reused_gpu_tokens"]),
    ("reused from CPU", lambda r: r["reused_cpu_tokens"]),
    ("efficiency", lambda r: f"{r['efficiency']:.3f}"),
    ("reused / reachable", lambda r: _fmt(r.get("efficiency_of_reachable"))),
    ("scheduler steps", lambda r: r["steps"]),
)


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}"


def render_comparison(paths: Sequence[str], out: TextIO) -> int:
    """Side by side: one column group per saved report (wheel), one column per configuration."""
    from hybrid_kv_plugin.sim.attribution import Bucket

    reports = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as handle:
                reports.append(json.load(handle))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"hybrid-kv: --compare {path}: {exc}") from None
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
        lines.append(f"{label:<{width}}" + _grouped([str(v) for v in values], groups, cell))
    out.write("".join(line.rstrip() + "\n" for line in lines))
    return 0


def _grouped(values: list[str], groups: list[tuple[str, int]], cell: int) -> str:
    text, i = "", 0
    for _, n in groups:
        text += " |" + "".join(f"{v:>{cell}}" for v in values[i : i + n])
        i += n
    return text


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(
            "hybrid-kv: --plot needs matplotlib, which is not installed here; "
            "install the optional extra: pip install 'hybrid-kv-plugin[plot]'"
        ) from None


def plot_report(report: dict, path: str) -> None:
    """Grouped bars per configuration: ideal, reused from the GPU, reused from the CPU (stacked)."""
    _require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in report["results"] if "refused" not in r]
    names = [r["name"] for r in ran]
    x = list(range(len(ran)))
    fig, ax = plt.subplots(figsize=(1.8 * max(len(ran), 2) + 2, 4))
    ax.bar([i - 0.2 for i in x], [r["ideal_tokens"] for r in ran], width=0.4, label="ideal", color="#bbbbbb")
    gpu = [r["reused_gpu_tokens"] for r in ran]
    ax.bar([i + 0.2 for i in x], gpu, width=0.4, label="reused from GPU", color="#3b75af")
    ax.bar(
        [i + 0.2 for i in x], [r["reused_cpu_tokens"] for r in ran], width=0.4, bottom=gpu,
        label="reused from CPU", color="#ef8636",
    )
    for i, r in enumerate(ran):
        ax.text(i + 0.2, r["reused_tokens"], f"{r['efficiency']:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, names)
    ax.set_ylabel("tokens")
    ax.set_title(f"hybrid-kv replay on vLLM {report['vllm']}: reused vs ideal")
    ax.set_ylim(0, 1.18 * max([r["ideal_tokens"] for r in ran] + [1]))
    ax.legend(fontsize=8, ncol=3, loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
