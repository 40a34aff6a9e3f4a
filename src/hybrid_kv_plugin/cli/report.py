"""``hybrid-kv replay``'s report: the JSON object it prints with ``--json`` and its text rendering."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TextIO


def build_report(
    segments: Sequence[Any], settings: Any, results: Sequence[Any], per_request: bool = False, model: Any = None
) -> dict:
    """``model``: the resolved model geometry, if any (it prices a Mamba state in bytes)."""
    from dataclasses import asdict

    from hybrid_kv_plugin import __version__
    from hybrid_kv_plugin.registration import current_adapter

    report: dict[str, Any] = {
        "vllm": current_adapter().version,
        "plugin": __version__,
        "settings": asdict(settings),
        "segments": [{"name": s.name, "requests": len(s.requests), "eagle": bool(s.eagle)} for s in segments],
        "results": [r.as_dict(per_request=per_request) for r in results],
    }
    conversation = [s.conversation for s in segments if getattr(s, "conversation", None) is not None]
    if conversation:
        report["conversation"] = conversation[0].as_dict()
    # A run on a resolved model prices states only when given the model (the sim's page is not its state).
    priced = model is not None or settings.max_model_len is None
    add_state_costs(report, model.as_dict() if model is not None else None, priced=priced)
    return report


def mamba_state_bytes(settings: dict, model: dict | None) -> int:
    """Bytes one Mamba state occupies: a page per Mamba layer of the resolved model; without a
    model, the simulator's own (one Mamba layer whose state fills one attention page)."""
    if model is not None:
        return model["mamba_layers"] * model["page_bytes"]
    from hybrid_kv_plugin.sim.geometry import HybridGeometry

    return HybridGeometry(attention_block_size=settings["attention_block_size"]).attention_page_bytes


def add_state_costs(report: dict, model: dict | None, priced: bool = True) -> None:
    """Price each configuration's kept Mamba states (``mamba_states``) in bytes (``priced``),
    and its prefill chunks per request against ``stock``'s in the same run
    (``extra_chunks_per_request``)."""
    state_bytes = mamba_state_bytes(report["settings"], model) if priced else 0
    report["mamba_state_bytes"] = state_bytes or None
    rows = [r for r in report["results"] if r.get("mamba_states")]
    baseline = next((r["mamba_states"]["prefill_chunks_per_request"] for r in rows if r["name"] == "stock"), None)
    for row in rows:
        states = row["mamba_states"]
        for tier in ("gpu", "cpu"):
            if tier in states and state_bytes:
                states[tier]["peak_bytes"] = states[tier]["peak"] * state_bytes
                states[tier]["mean_bytes"] = round(states[tier]["mean"] * state_bytes)
        if baseline is not None:
            states["extra_chunks_per_request"] = round(states["prefill_chunks_per_request"] - baseline, 3)


def best_stock(results: Sequence[dict]) -> dict | None:
    """The ``stock…`` configuration that reused the most (stock at its best in this run)."""
    stock = [r for r in results if r["name"].startswith("stock") and "refused" not in r]
    return max(stock, key=lambda r: r["reused_tokens"]) if stock else None


def render_report(report: dict, out: TextIO) -> None:
    w = out.write
    s = report["settings"]
    segs = ", ".join(f"{x['name']} {x['requests']}{' with EAGLE' if x['eagle'] else ''}" for x in report["segments"])
    requests = sum(x["requests"] for x in report["segments"])
    w(f"hybrid-kv replay on vLLM {report['vllm']}: {requests} requests ({segs})\n")
    refused = report.get("refused_requests") or {}
    if refused:
        reasons = "; ".join(f"{reason.replace('_', ' ')}: {count}" for reason, count in refused.items())
        from hybrid_kv_plugin.cli.replay_inputs import DEFAULT_MAX_MODEL_LEN

        limit = s["max_model_len"] or DEFAULT_MAX_MODEL_LEN
        w(
            f"refused: {sum(refused.values())} request(s) vLLM would answer with an error (max model length "
            f"{limit}), left out: {reasons}\n"
        )
    model = report.get("model_geometry")
    if model is not None:
        from hybrid_kv_plugin.models.geometry import ModelGeometry, describe

        w(f"geometry: {describe(ModelGeometry(**model))}\n")
    else:
        w(
            f"geometry: FA {s['attention_block_size']} / Mamba {s['mamba_block_size']} {s['mamba_cache_mode']} / "
            f"prefix-match unit {s['hash_block_size']}; GPU {s['gpu_blocks']} blocks, CPU {s['cpu_blocks']} blocks\n"
        )
    for note in report.get("pool_notes", ()):
        w(f"pools: {note}\n")
    results = report["results"]
    ran = [r for r in results if "refused" not in r]
    conversation = report.get("conversation")
    if conversation is not None:
        ideal = f"; ideal under it {ran[0]['ideal_tokens']} tokens" if ran else ""
        w(
            f"conversation model: {conversation['model']}: {conversation['continued_requests']} request(s) continue an "
            f"earlier one, with {conversation['answer_tokens']} answer tokens in their prompts{ideal}\n"
        )
    w("\n")
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
    if ran:
        _render_details(report, ran, w)
    if "tier_ceiling" in report:
        _render_tier_ceiling(report["tier_ceiling"], w)
    for hint in report.get("next_steps", ()):
        w(f"\nnext step: {hint}\n")


def _render_details(report: dict, ran: list[dict], w: Any) -> None:
    from hybrid_kv_plugin.sim.attribution import Bucket

    names = [r["name"] for r in ran]
    width = max(16, *(len(n) + 1 for n in names))
    row = "{:<32}" + "".join(f" {{:>{width}}}" for _ in names) + "\n"
    w("\n" + " " * 32 + "".join(f" {n:>{width}}" for n in names) + "\n")
    w(row.format("hits from the GPU cache", *(f"{_share(r['reused_gpu_tokens'], r['prompt_tokens'])}" for r in ran)))
    w(row.format("hits from the CPU tier", *(f"{_share(r['reused_cpu_tokens'], r['prompt_tokens'])}" for r in ran)))
    w("  (share of all prompt tokens)\n")
    best = best_stock(ran)
    if best is not None and len(ran) > 1:
        w(row.format("reused / best stock", *(_ratio(r["reused_tokens"], best["reused_tokens"]) for r in ran)))
        w(f"  (stock at its best in this run: {best['name']}, at the same GPU and CPU memory)\n")
    if all("ttft_steps" in r for r in ran):
        w(row.format("TTFT steps mean / p90", *(f"{r['ttft_steps']['mean']:.1f} / {r['ttft_steps']['p90']}" for r in ran)))
    if all("timing" in r for r in ran):
        w(row.format("wall s", *(r["timing"]["wall_s"] for r in ran)))
        w(row.format("requests/s", *(r["timing"]["requests_per_s"] for r in ran)))
        w(row.format("scheduler steps/s", *(r["timing"]["steps_per_s"] for r in ran)))
        w(row.format("peak RSS MiB (process)", *(r["timing"]["peak_rss_mib"] for r in ran)))
        if "startup_s" in report:
            w(f"  (wall s is each configuration's own run; start-up before the first: {report['startup_s']} s)\n")
    if all(r.get("mamba_states") for r in ran):
        _render_states(report, ran, row, w)
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


def _render_tier_ceiling(c: dict, w: Any) -> None:
    """The ``--tier-ceiling`` section (:mod:`hybrid_kv_plugin.sim.tier_ceiling`)."""
    block_bytes = c.get("block_bytes")

    def size(blocks: int) -> str:
        return f"{blocks:,} blocks" + (f" ({_bytes(blocks * block_bytes)})" if block_bytes else "")

    w(
        f"\nCPU tier ceiling (a block model of this workload: {size(c['tier_blocks'])} of {c['block_tokens']} "
        f"tokens, attention only, requests one after another; ideal {c['ideal_tokens']:,} tokens)\n"
    )
    w(f"  LRU keeps {c['lru_efficiency']:.3f} of it, the offline optimum (Belady) {c['offline_efficiency']:.3f}\n")
    for order, key in (("LRU", "lru_blocks_for"), ("the offline optimum", "offline_blocks_for")):
        needed = " and ".join(f"{share} from {size(blocks)}" for share, blocks in c[key].items())
        w(f"  {order} keeps {needed}\n")


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _ratio(part: int, whole: int) -> str:
    return f"{part / whole:.3f}" if whole else "-"


def _render_states(report: dict, ran: list[dict], row: str, w: Any) -> None:
    model = report.get("model_geometry")
    state_bytes = mamba_state_bytes(report["settings"], model) if model else report.get("mamba_state_bytes")
    state_bytes = state_bytes or mamba_state_bytes(report["settings"], None)
    states = [r["mamba_states"] for r in ran]
    w(f"\nMamba states kept (cached state blocks, sampled as requests finish; {_bytes(state_bytes)} a state)\n")
    for tier, label in (("gpu", "GPU prefix cache"), ("cpu", "CPU tier")):
        if not all(tier in s for s in states):
            continue
        w(row.format(f"  {label} peak / mean", *(f"{s[tier]['peak']} / {s[tier]['mean']:g}" for s in states)))
        w(row.format(f"  {label} peak bytes", *(_bytes(s[tier]["peak"] * state_bytes) for s in states)))
    w(row.format("  prefill chunks / request", *(f"{s['prefill_chunks_per_request']:.3f}" for s in states)))
    if all("extra_chunks_per_request" in s for s in states):
        w(row.format("  extra chunks / request vs stock", *(f"{s['extra_chunks_per_request']:+.3f}" for s in states)))


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
