"""``hybrid-kv replay --engines N``: a Mooncake trace on N engines behind a router.

Reads the inputs as ``replay`` does (trace, model geometry, serve line, refused requests,
pools), then runs each configuration on N engines once per CPU tier (:mod:`hybrid_kv_plugin.sim.cluster`):
``per-engine`` (each engine its own tier of the resolved CPU size) and ``shared`` (one tier
of N times it, the Mooncake store's case). ``--baseline`` adds one engine with one GPU and a
CPU tier of the N tiers' sum, and the report gives each cluster's reuse over it.
``--engines 1`` (the default) is the single-engine replay, untouched.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from hybrid_kv_plugin.cli import replay_inputs as inputs
from hybrid_kv_plugin.cli.errors import fail


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from hybrid_kv_plugin.sim.cluster import ROUTERS, TIERS

    g = parser.add_argument_group("cluster (Mooncake traces)")
    g.add_argument(
        "--engines", type=int, default=1, metavar="N",
        help="replay on N engines behind a router, each with its own GPU cache (default 1: the single-engine replay)",
    )
    g.add_argument(
        "--router", choices=ROUTERS, default=None,
        help="with --engines N > 1: round-robin (default: arrival order) or session (every turn of a "
        "conversation on one engine)",
    )
    g.add_argument(
        "--cpu-tier", default=None, metavar="TIERS",
        help=f"with --engines N > 1: comma-separated from {', '.join(TIERS)} (default both): one CPU tier per "
        "engine of the resolved size, or one store tier of N times it shared by all engines",
    )
    g.add_argument(
        "--baseline", action="store_true",
        help="with --engines N > 1: also run one engine whose CPU tier is the sum of the N tiers, and report "
        "each cluster's reuse over it",
    )


def requested(args: argparse.Namespace) -> bool:
    """The cluster runner handles this command line (anything but a plain single-engine replay)."""
    return args.engines != 1 or args.router is not None or args.cpu_tier is not None or args.baseline


def _tiers(args: argparse.Namespace) -> list[str]:
    from hybrid_kv_plugin.sim.cluster import TIERS

    if args.cpu_tier is None:
        return list(TIERS)
    tiers = [t.strip() for t in args.cpu_tier.split(",") if t.strip()]
    if not tiers or any(t not in TIERS for t in tiers):
        fail(f"--cpu-tier {args.cpu_tier!r}: allowed: {', '.join(TIERS)}")
    return tiers


def check_flags(args: argparse.Namespace) -> None:
    """The cluster's own flags, before any file is read."""
    if args.engines < 1:
        fail(f"--engines must be >= 1, got {args.engines}")
    if args.engines == 1:
        fail("--router, --cpu-tier and --baseline apply to --engines N > 1")
    for flag, given in (("--cold-replay", args.cold_replay), ("--plot", args.plot)):
        if given:
            fail(f"{flag} is not available with --engines N > 1")
    if not args.trace:
        fail("--engines N > 1 replays a Mooncake trace (--trace FILE.jsonl): its timestamps clock the engines")
    _tiers(args)


def _parents(args: argparse.Namespace, segment: Any) -> list[int]:
    """Each request's conversation parent, read from the trace's hash ids (file order)."""
    from hybrid_kv_plugin.sim.cluster import session_parents
    from hybrid_kv_plugin.sim.mooncake import DEFAULT_BLOCK_TOKENS, lines_of, parse_line

    block_tokens = args.trace_block_tokens or DEFAULT_BLOCK_TOKENS
    if (args.conversation_model or "continuation") != "continuation":
        return [-1] * len(segment.requests)

    def lines() -> Any:
        with open(args.trace, encoding="utf-8") as handle:
            for count, (number, item) in enumerate(lines_of(handle)):
                if args.limit is not None and count >= args.limit:
                    return
                _stamp, input_length, _output, hash_ids = parse_line(item, number, block_tokens)
                yield hash_ids, input_length

    parents = session_parents(lines(), block_tokens)
    continued = sum(p >= 0 for p in parents)
    stats = getattr(segment, "conversation", None)
    if stats is not None and continued != stats.continued_requests:
        raise RuntimeError(f"session reading found {continued} continued requests, the prompts {stats.continued_requests}")
    return parents


def run_cluster_command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    from hybrid_kv_plugin.cli.args import choose_configs, settings_from
    from hybrid_kv_plugin.sim.cluster import ClusterInputError, replay_cluster, route
    from hybrid_kv_plugin.sim.mooncake import TimedSegment

    check_flags(args)
    inputs.check_flags(args)
    segments = inputs.load_segments(args)
    if len(segments) != 1 or not isinstance(segments[0], TimedSegment):
        fail("--engines N > 1 replays a Mooncake trace (timestamps clock the engines); this trace is in the project's format")
    settings = settings_from(args)
    configs = choose_configs(args.configs or "plugin", segments)
    model, settings, segments, refused, pool_notes = inputs.prepare_inputs(args, settings, segments)
    segment = segments[0]
    router = args.router or "round-robin"
    parents = _parents(args, segment) if router == "session" else None
    if parents is not None and refused:
        # Requests vLLM refuses left the segment (ids stay mc<file index>): re-index the
        # parents onto the kept requests; a turn whose parent was refused starts a conversation.
        position = {int(r.request_id[2:]): i for i, r in enumerate(segment.requests)}
        parents = [position.get(parents[int(r.request_id[2:])], -1) for r in segment.requests]
    try:
        assignment = route(len(segment.requests), args.engines, router, parents)
    except ClusterInputError as exc:
        fail(str(exc))
    from dataclasses import replace

    from hybrid_kv_plugin.cli.progress import Progress

    total = len(segment.requests)
    runs: list[tuple[str, Any, int, str, list[int]]] = []
    for config in configs:
        if args.baseline:
            runs.append(("baseline", config, 1, "per-engine", [0] * total))
        for tier in _tiers(args):
            runs.append((tier, config, args.engines, tier, assignment))
    progress = Progress(total, lines=True)
    rows: list[dict[str, Any]] = []
    for number, (label, config, engines, tier, routed) in enumerate(runs, start=1):
        progress.start(f"{config.name} {label} [{number}/{len(runs)}]", total)
        run_settings = settings if label != "baseline" else replace(settings, cpu_blocks=settings.cpu_blocks * args.engines)
        started = _wall()
        result = replay_cluster(
            segment, run_settings, config, engines=engines, tier=tier, assignment=routed, router=router,
            per_request=args.per_request, progress=progress.update,
        )
        row = result.as_dict(per_request=args.per_request)
        row["run"] = label
        row["wall_s"] = round(_wall() - started, 1)
        rows.append(row)
    progress.close()
    _ratios(rows)
    import dataclasses

    import vllm

    report: dict[str, Any] = {
        "vllm": vllm.__version__,
        "engines": args.engines,
        "router": router,
        "settings": dataclasses.asdict(settings),
        "requests": total,
        "results": rows,
    }
    if parents is not None:
        report["conversations"] = sum(p < 0 for p in parents)
    inputs.add_input_notes(report, refused, pool_notes, model)
    if args.json:
        out.write(json.dumps(report, indent=2) + "\n")
    else:
        render(report, out)
    return 0


def _ratios(rows: list[dict[str, Any]]) -> None:
    """Each cluster row's reuse over its configuration's baseline row, where one ran."""
    base = {r["config"]: r for r in rows if r.get("run") == "baseline" and "refused" not in r}
    for row in rows:
        b = base.get(row["config"])
        if row.get("run") != "baseline" and b is not None and "refused" not in row:
            row["reuse_over_baseline"] = round(row["reused_tokens"] / b["reused_tokens"], 4) if b["reused_tokens"] else None


def render(report: dict[str, Any], out: TextIO) -> None:
    out.write(
        f"vLLM {report['vllm']}: {report['requests']} requests on {report['engines']} engines, router {report['router']}\n"
    )
    header = f"{'config':<18} {'run':<11} {'engines':>7} {'CPU blocks':>10} {'reused':>12} {'eff.':>7} " \
             f"{'own GPU':>12} {'own CPU':>12} {'other eng.':>12} {'vs base':>8}\n"
    out.write(header)
    for row in report["results"]:
        if "refused" in row:
            out.write(f"{row['config']:<18} {row.get('run', row['tier']):<11} refused: {row['refused']}\n")
            continue
        hits = row["hits_by_source"]
        ratio = row.get("reuse_over_baseline")
        out.write(
            f"{row['config']:<18} {row['run']:<11} {row['engines']:>7} {row['cpu_blocks_total'] if row['tier'] == 'shared' else row['cpu_blocks_per_engine']:>10} "
            f"{row['reused_tokens']:>12,} {row['efficiency']:>7.3f} {hits['own_gpu']:>12,} {hits['own_cpu']:>12,} "
            f"{hits['other_engine_cpu']:>12,} {'' if ratio is None else f'{ratio:.3f}':>8}\n"
        )
        for engine in row["per_engine"] if row["engines"] > 1 else ():
            out.write(
                f"{'':<18} {'  engine ' + str(engine['index']):<11} {engine['requests']:>7} {'':>10} "
                f"{engine['reused_tokens']:>12,} {engine['efficiency']:>7.3f} {engine['reused_gpu_tokens']:>12,} "
                f"{engine['reused_cpu_own_tokens']:>12,} {engine['reused_cpu_other_tokens']:>12,}\n"
            )
    out.write("CPU blocks: one engine's tier (per-engine, baseline) or the shared store's; "
              "eff. = reused / ideal (the trace's reusable prefix as one unbounded cache sees it)\n")


def _wall() -> float:
    import time

    return time.monotonic()
