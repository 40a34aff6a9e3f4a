"""A multi-turn chat on a hybrid (attention + Mamba ``align``) model, served from the CPU tier.

Drives the installed vLLM wheel's real scheduler, KV-cache manager and SimpleCPU
connector on a CPU (no model runs; see ``hybrid_kv_plugin.sim``). Each turn sends
the whole conversation so far plus a new user message; before each turn the GPU
prefix cache is evicted (as memory pressure would), so whatever the turn reuses
comes from the CPU tier. The same conversation runs through
``HybridSimpleCPUConnector`` and through the wheel's stock
``SimpleCPUOffloadConnector``.

How to run it: with the Python of a vLLM environment that has the plugin installed (a bare
``python`` without them fails with ``ModuleNotFoundError``). From a checkout, ``scripts/demo``
or ``scripts/test --setup-only 0.29.0`` builds such an environment under ``.venvs/``:

    .venvs/vllm-0.29.0/bin/python examples/multi_turn_cpu_offload.py [--turns 6] [--user-tokens 37] [--reply-tokens 12]

or, in your own vLLM environment after ``pip install --no-deps <checkout or wheel>``,
``python examples/multi_turn_cpu_offload.py``. CPU only, no GPU, no weights; ~10 s after
vLLM's imports. ``tests/test_examples.py`` runs it.

Geometry: attention block 16, Mamba block 64, hash (prefix-match) block 16.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is the example's report

from hybrid_kv_plugin.sim.geometry import offline_environment  # noqa: E402

offline_environment()  # HF_HUB_OFFLINE=1 and a private VLLM_CACHE_ROOT, removed when the example exits


def conversation(turns: int, system_tokens: int, user_tokens: int, reply_tokens: int) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) per turn; every prompt extends the previous one by its reply and a new message."""
    from hybrid_kv_plugin.sim.engine import SAMPLED_TOKEN

    def message(turn: int, n: int) -> list[int]:
        return [(turn * 7919 + i * 37) % 1000 + 1 for i in range(n)]

    prompt = message(0, system_tokens)
    plan = []
    for turn in range(1, turns + 1):
        prompt = prompt + message(turn, user_tokens)
        plan.append((prompt, reply_tokens))
        # The simulated model answers SAMPLED_TOKEN every step; the reply joins the history.
        prompt = prompt + [SAMPLED_TOKEN] * reply_tokens
    return plan


def serve(adapter, connector: str, plan, extra: dict):
    """Run the conversation; (CPU-tier hit per turn, the connector)."""
    from hybrid_kv_plugin.sim import HybridGeometry, SimEngine
    from hybrid_kv_plugin.sim.invariants import OffloadInvariants

    # 4 MiB of CPU blocks: 16x the tiny model's GPU pool, so nothing is evicted from the CPU tier.
    engine = SimEngine(HybridGeometry(), adapter=adapter, kv_connector=connector,
                       kv_connector_extra_config={"cpu_bytes_to_use": 1 << 22, **extra})
    invariants = OffloadInvariants(engine)
    hits = []
    for turn, (prompt, max_tokens) in enumerate(plan):
        assert engine.reset_prefix_cache()
        hits.append(engine.run([(f"turn{turn}", prompt)], max_tokens=max_tokens)[f"turn{turn}"])
    invariants.check()  # CPU blocks released, nothing stored twice, loads at their hash's position
    return hits, engine.connector


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=200)
    parser.add_argument("--user-tokens", type=int, default=37)
    parser.add_argument("--reply-tokens", type=int, default=12)
    args = parser.parse_args(argv)

    import hybrid_kv_plugin
    from hybrid_kv_plugin.config import PluginConfigError
    from hybrid_kv_plugin.connector_names import CONNECTOR_NAME, STOCK_CONNECTOR_NAME
    from hybrid_kv_plugin.registration import current_adapter

    hybrid_kv_plugin.register()
    adapter = current_adapter()
    plan = conversation(args.turns, args.system_tokens, args.user_tokens, args.reply_tokens)

    extra: dict = {}
    try:
        plugin_hits, plugin = serve(adapter, CONNECTOR_NAME, plan, extra)
    except PluginConfigError as refused:
        print(f"{refused}\n-> running HybridSimpleCPUConnector with fine_grained_hits=false instead")
        extra = {"fine_grained_hits": False}
        plugin_hits, plugin = serve(adapter, CONNECTOR_NAME, plan, extra)
    stock_hits, _ = serve(adapter, STOCK_CONNECTOR_NAME, plan, {})

    print(f"vLLM {adapter.version}; HybridSimpleCPUConnector runs the {plugin.offload_mode.value} SimpleCPU behaviour")
    print(f"{'turn':>4} {'prompt':>7} {'CPU hit (plugin)':>17} {'CPU hit (stock)':>16}")
    for turn, ((prompt, _), mine, theirs) in enumerate(zip(plan, plugin_hits, stock_hits), start=1):
        print(f"{turn:>4} {len(prompt):>7} {mine:>17} {theirs:>16}")
    total = sum(len(p) for p, _ in plan)
    print(f"reused {sum(plugin_hits)}/{total} prompt tokens with the plugin, {sum(stock_hits)}/{total} stock")
    counters = plugin.get_boundary_store_stats().as_dict()
    print("Mamba boundary-store outcomes (plugin):", ", ".join(f"{k}={v}" for k, v in counters.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
