"""GPU end-to-end check: real ``vllm serve`` with the plugin on a tiny dummy-weight hybrid model.

How to run it: with the Python of a vLLM environment that has the plugin installed (from a
checkout, ``scripts/test --setup-only 0.33.0`` builds one under ``.venvs/``; on a GPU machine,
your own CUDA vLLM environment after ``pip install --no-deps <checkout or wheel>``):

    .venvs/vllm-0.33.0/bin/python examples/gpu_e2e.py --dry-run   # any machine, CPU: build + validate the command lines
    python examples/gpu_e2e.py                                    # one GPU: run stock, then plugin, print the figures

``tests/test_examples.py`` runs the ``--dry-run`` on CPU; the GPU run needs a GPU and a CUDA vLLM.

Each run starts ``vllm serve`` on the tiny Qwen3-Next config shipped in the plugin
(``--load-format dummy``, no tokenizer: token-id prompts), sends a cold set of long
shared-prefix prompts, evicts the GPU prefix cache (``/reset_prefix_cache``, dev mode),
replays them, and reports: cold vs replay outputs identical (greedy), CPU-tier hit
tokens / queried tokens (vLLM's external prefix-cache metrics), TTFT cold vs replay.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
import urllib.request

from hybrid_kv_plugin.sim.geometry import MODEL_DIR, data_dir

PORT = 8765
BASE = f"http://127.0.0.1:{PORT}"


def serve_command(connector: str) -> list[str]:
    kv = {"kv_connector": connector, "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": 4 << 30}}
    return [
        "vllm", "serve", data_dir(MODEL_DIR), "--port", str(PORT), "--load-format", "dummy",
        "--skip-tokenizer-init", "--enable-prefix-caching", "--mamba-cache-mode", "align",
        "--block-size", "16", "--mamba-block-size", "64", "--prefix-match-unit", "16",
        "--max-model-len", "4096", "--gpu-memory-utilization", "0.3", "--enforce-eager",
        "--kv-transfer-config", json.dumps(kv),
    ]


def validate(command: list[str]) -> list[str]:
    """The command line as ``hybrid-kv doctor`` judges it (errors; empty when valid)."""
    from hybrid_kv_plugin.cli.serve_args import check_serve_args
    from hybrid_kv_plugin.registration import current_adapter

    return check_serve_args(command[3:], current_adapter()).errors


def _post(path: str, payload: dict | None = None) -> dict:
    data = json.dumps(payload or {}).encode()
    req = urllib.request.Request(BASE + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        body = resp.read()
    return json.loads(body) if body else {}


def _metric(name: str) -> float:
    with urllib.request.urlopen(BASE + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{") or line.startswith(name + " "))


def _complete(tokens: list[int]) -> tuple[list, float]:
    start = time.perf_counter()
    out = _post("/v1/completions", {"model": data_dir(MODEL_DIR), "prompt": tokens, "max_tokens": 1, "temperature": 0})
    return out["choices"][0].get("token_ids") or out["choices"][0].get("text"), time.perf_counter() - start


def run_once(connector: str, prompts: list[list[int]]) -> dict:
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    server = subprocess.Popen(serve_command(connector), env=env)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(BASE + "/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        cold = [_complete(p) for p in prompts]
        queries0, hits0 = _metric("vllm:external_prefix_cache_queries_total"), _metric("vllm:external_prefix_cache_hits_total")
        _post("/reset_prefix_cache")
        replay = [_complete(p) for p in prompts]
        return {
            "connector": connector,
            "outputs_identical": [c[0] for c in cold] == [r[0] for r in replay],
            "external_hit_tokens": _metric("vllm:external_prefix_cache_hits_total") - hits0,
            "external_queried_tokens": _metric("vllm:external_prefix_cache_queries_total") - queries0,
            "ttft_cold_ms": round(1000 * sum(c[1] for c in cold) / len(cold), 1),
            "ttft_replay_ms": round(1000 * sum(r[1] for r in replay) / len(replay), 1),
        }
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="build and validate the command lines only")
    args = parser.parse_args()
    rng = random.Random(0)
    shared = [rng.randrange(1, 1000) for _ in range(2000)]
    prompts = [shared[:1000 + 37 * k] + [rng.randrange(1, 1000) for _ in range(21)] for k in range(8)]
    commands = {name: serve_command(name) for name in ("SimpleCPUOffloadConnector", "HybridSimpleCPUConnector")}
    for name, command in commands.items():
        errors = validate(command)
        print(f"{name}: {'valid' if not errors else 'INVALID: ' + '; '.join(errors)}")
        if errors:
            return 2
    if args.dry_run:
        return 0
    if shutil.which("nvidia-smi") is None:
        print("no GPU on this machine: run with --dry-run, or on a GPU host")
        return 3
    results = [run_once(name, prompts) for name in commands]
    print(json.dumps(results, indent=2))
    return 0 if all(r["outputs_identical"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
