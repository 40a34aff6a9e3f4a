"""``hybrid-kv replay``: what a workload would reuse on this wheel, stock vs plugin, on a CPU."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TextIO


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", help="JSONL trace (see README); default: the embedded workload")
    parser.add_argument("--seed", type=int, default=0, help="seed of the embedded workload")
    parser.add_argument("--scale", type=int, default=1, help="size multiplier of the embedded workload")
    parser.add_argument("--attention-block-size", type=int, default=16)
    parser.add_argument("--mamba-block-size", type=int, default=64)
    parser.add_argument("--prefix-match-unit", type=int, default=16)
    parser.add_argument("--gpu-blocks", type=int, default=4096)
    parser.add_argument("--cpu-bytes", type=int, default=1 << 26)
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run_replay_command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    from hybrid_kv_plugin.sim.geometry import HybridGeometry
    from hybrid_kv_plugin.sim.replay import DEFAULT_CONFIGS, replay
    from hybrid_kv_plugin.sim.workload import default_workload, load_trace

    if args.trace:
        with open(args.trace, encoding="utf-8") as handle:
            workload = load_trace(handle)
    else:
        workload = default_workload(seed=args.seed, scale=args.scale)
    geometry = HybridGeometry(
        attention_block_size=args.attention_block_size,
        mamba_block_size=args.mamba_block_size,
        hash_block_size=args.prefix_match_unit,
        num_gpu_blocks=args.gpu_blocks,
    )
    show_progress = not args.json and sys.stderr.isatty()
    results = []
    for config in DEFAULT_CONFIGS:
        progress = None
        if show_progress:
            def progress(done: int, name: str = config.name) -> None:
                sys.stderr.write(f"\r{name}: {done}/{len(workload)} requests")
                sys.stderr.flush()
        results.append(replay(workload, geometry, config, cpu_bytes=args.cpu_bytes, progress=progress))
        if show_progress:
            sys.stderr.write("\n")
    from hybrid_kv_plugin.registration import current_adapter

    version = current_adapter().version
    if args.json:
        out.write(json.dumps({"vllm": version, "results": [r.as_dict() for r in results]}, indent=2) + "\n")
        return 0
    out.write(f"hybrid-kv replay on vLLM {version}: {len(workload)} requests, geometry FA {geometry.attention_block_size} / "
              f"Mamba {geometry.mamba_block_size} {geometry.mamba_cache_mode} / prefix-match unit {geometry.hash_block_size}\n\n")
    header = ("config", "prompt tok", "ideal", "reused", "from GPU", "from CPU", "lost", "efficiency", "steps")
    out.write("{:<8} {:>10} {:>7} {:>7} {:>9} {:>9} {:>6} {:>10} {:>6}\n".format(*header))
    for r in results:
        out.write(
            f"{r.name:<8} {r.prompt_tokens:>10} {r.ideal_tokens:>7} {r.reused_tokens:>7} {r.reused_gpu_tokens:>9} "
            f"{r.reused_cpu_tokens:>9} {r.lost_tokens:>6} {r.efficiency:>10.3f} {r.steps:>6}\n"
        )
    return 0
