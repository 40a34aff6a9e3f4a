"""A Mooncake cluster on this machine for the engine tests: ``mooncake_master`` and engine processes.

Every listener the test can narrow binds 127.0.0.1 (the master's RPC, HTTP metadata and
metrics servers; each client's local hostname). Ports are free ones picked at start.
Everything is stopped by the PID it was started with, and :func:`leftovers` names what a
stopped cluster left behind (processes, files in its temp directory, new /dev/shm entries).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


class Master:
    """``mooncake_master`` on loopback; ``restart()`` keeps its ports (clients reconnect to them)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.proc: subprocess.Popen | None = None
        self.pids: list[int] = []

    @property
    def options(self) -> dict[str, Any]:
        return {"master": f"127.0.0.1:{self.rpc_port}", "metadata_server": f"http://127.0.0.1:{self.http_port}/metadata"}

    def start(self) -> None:
        binary = Path(sys.executable).with_name("mooncake_master")
        log = open(self.workdir / "master.log", "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            [str(binary), f"--port={self.rpc_port}", "--rpc_address=127.0.0.1",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={self.http_port}", "--metrics_host=127.0.0.1",
             f"--metrics_port={self.metrics_port}"],
            cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()  # the child keeps its own descriptor
        self.pids.append(self.proc.pid)
        wait_listening(self.rpc_port)
        wait_listening(self.http_port)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


class Engine:
    """One engine process (``mooncake_engine.py``), answering one command at a time."""

    def __init__(
        self, model_dir: Path, store_options: dict[str, Any], workdir: Path, name: str, additional_config: dict[str, Any]
    ) -> None:
        env = dict(os.environ, PYTHONHASHSEED="0")
        self.log_path = workdir / f"{name}.log"
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child  # block hashes, so store keys, equal across engines
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "mooncake_engine.py"), str(model_dir), json.dumps(store_options),
             json.dumps(additional_config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, cwd=workdir, env=env,
        )  # fmt: skip
        log.close()
        self.pid = self.proc.pid
        line = self._line("READY ")
        self.ready = json.loads(line)

    def _line(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :]
        code = self.proc.wait()
        # The workdir goes with the cluster: the engine's last log lines travel in the error.
        lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if not line.startswith(("I1", "W1"))]
        tail = "\n".join(lines[-40:])
        raise RuntimeError(f"engine {self.pid} exited with {code} before {prefix.strip()}; its log ends:\n{tail}")

    def call(self, **command: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line("RESULT "))

    def generate(self, prompt: list[int], max_tokens: int, salt: str | None = None) -> dict[str, Any]:
        return self.call(op="generate", prompt=list(prompt), max_tokens=max_tokens, salt=salt)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(op="exit")
                self.proc.wait(timeout=60)
            except (OSError, RuntimeError, subprocess.TimeoutExpired, ValueError):
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait()


def make_workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="hybrid-kv-mooncake-"))


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def remove_workdir(workdir: Path) -> None:
    shutil.rmtree(workdir, ignore_errors=True)
