"""``hybrid-kv replay --cold-replay``: the replay external hit per configuration, exact numbers.

Workload: four prompts of 320, 336, 368 and 496 tokens (4 output tokens each), then
the same four again after the GPU prefix cache is evicted. The second pass can only
be served by the CPU tier; each exact replay reaches at most the last hash boundary
<= N-1: 304 + 320 + 352 + 480 = 1456 of its 1520 prompt tokens.
"""

from __future__ import annotations

import io


from hybrid_kv_plugin.cli.main import main
from hybrid_kv_plugin.sim.cold_replay import REPLAY_PREFIX, cold_replay_segments, replay_external_hit
from hybrid_kv_plugin.sim.configs import CONFIGS
from hybrid_kv_plugin.sim.replay import ReplaySettings, replay
from hybrid_kv_plugin.sim.workload import Segment, TraceRequest

from helpers import tokens

PROMPTS = (320, 336, 368, 496)
BEST = 304 + 320 + 352 + 480


def _workload() -> list[Segment]:
    requests = tuple(
        TraceRequest(f"p{n}", wave=0, prompt_token_ids=tuple(tokens(n, offset=7 * i)), max_tokens=4)
        for i, n in enumerate(PROMPTS)
    )
    return [Segment("replays", requests)]


def test_second_pass_is_the_same_prompts_after_an_eviction():
    (segment,) = cold_replay_segments(_workload())
    first, second = segment.requests[:4], segment.requests[4:]
    assert [r.request_id for r in second] == [REPLAY_PREFIX + r.request_id for r in first]
    assert [r.prompt_token_ids for r in second] == [r.prompt_token_ids for r in first]
    assert [(r.wave, r.evict_gpu_before) for r in second] == [(1, True)] * 4


# CPU-tier tokens of the replay pass per configuration (of 1520 prompt tokens).
STOCK = {"0.29.0": 0, "0.30.0": 0, "0.31.0": 0, "0.32.0": BEST, "0.33.0": BEST}
PLUGIN = {"0.29.0": 0, "0.30.0": 0, "0.31.0": 0, "0.32.0": BEST, "0.33.0": BEST}


def _tail_refusal(adapter, mode: str) -> str:
    return (
        f"invalid hybrid-kv-plugin configuration: hybrid_kv.prompt_tail_checkpoint: {mode!r} needs "
        f"vLLM >= 0.29.0 and this is vLLM {adapter.version} (allowed here: native)"
    )


def test_replay_external_hit_per_configuration(adapter):
    segments = cold_replay_segments(_workload())
    settings = ReplaySettings(gpu_blocks=256, cpu_blocks=4096)
    if not adapter.prompt_tail_checkpoint_supported:
        # 0.26-0.28: the tail configurations are refused, as a server's start-up would be.
        refused = {name: replay(segments, settings, CONFIGS[name]).refused
                   for name in ("plugin+tail-replay", "plugin+tail-both")}
        assert refused == {"plugin+tail-replay": _tail_refusal(adapter, "replay"),
                           "plugin+tail-both": _tail_refusal(adapter, "both")}
        return
    hits = {
        name: replay_external_hit(replay(segments, settings, CONFIGS[name]))
        for name in ("stock", "plugin", "plugin+tail-replay", "plugin+tail-both")
    }
    assert {name: hit["prompt_tokens"] for name, hit in hits.items()} == dict.fromkeys(hits, 1520)
    assert {name: hit["cpu_tokens"] for name, hit in hits.items()} == {
        "stock": STOCK[adapter.version],
        "plugin": PLUGIN[adapter.version],
        "plugin+tail-replay": BEST,
        "plugin+tail-both": BEST,
    }
    assert hits["plugin+tail-both"]["ratio"] == round(BEST / 1520, 4) == 0.9579


def test_cli_reports_the_replay_external_hit(adapter, tmp_path, monkeypatch):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(
        f'{{"id": "p{n}", "tokens": {tokens(n, offset=7 * i)}, "max_tokens": 4, "wave": 0}}\n'
        for i, n in enumerate(PROMPTS)
    ))
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    assert main(["replay", "--cold-replay", "--trace", str(trace), "--configs", "plugin+tail-both"]) == 0
    text = out.getvalue()
    if not adapter.prompt_tail_checkpoint_supported:
        assert _tail_refusal(adapter, "both") in text
        return
    assert "replay external hit (cold -> replay" in text
    lines = [line.split() for line in text.splitlines()]
    assert ["CPU-tier", "hit", "tokens", "1456"] in lines
    assert ["replay", "prompt", "tokens", "1520"] in lines
    assert ["replay", "external", "hit", "0.9579"] in lines
