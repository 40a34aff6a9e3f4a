"""``scripts/test`` (the README's test command) interrupted: its temp folders go and its pytest stops.

The wheel under test is the one this suite runs in (its venv, already built by ``scripts/test``);
the interrupted run's own pytest runs one test that waits, so the signal lands mid-run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import alive

ROOT = Path(__file__).resolve().parents[1]
WAITING_TEST = """\
import os, time

def test_waits():
    with open(os.environ["HYBRID_KV_TEST_MARKER"], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
"""


def test_an_interrupted_run_removes_its_temp_folders_and_stops_its_pytest(tmp_path):
    venv = Path(sys.prefix)
    version = venv.name.removeprefix("vllm-")
    assert (ROOT / "scripts" / "pins" / f"{venv.name}.txt").is_file(), f"{venv} is not a scripts/test venv"
    scratch, logs, suite = tmp_path / "tmp", tmp_path / "logs", tmp_path / "suite"
    for folder in (scratch, logs, suite):
        folder.mkdir()
    (suite / "test_waiting.py").write_text(WAITING_TEST)
    marker = tmp_path / "pytest.pid"
    env = dict(
        os.environ,
        TMPDIR=str(scratch),
        HYBRID_KV_VENV_ROOT=str(venv.parent),
        HYBRID_KV_NO_BUILD="1",  # never rebuild the venv this suite runs in
        HYBRID_KV_LOG_DIR=str(logs),
        HYBRID_KV_TESTS=str(suite / "test_waiting.py"),
        HYBRID_KV_TEST_MARKER=str(marker),
    )
    out = tmp_path / "out.txt"
    with out.open("w") as sink:  # a file, not a pipe: a child left running cannot hold it open
        run = subprocess.Popen(
            ["bash", str(ROOT / "scripts" / "test"), version],
            cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
        )
    inner = None
    try:
        deadline = time.monotonic() + 300
        while not marker.exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), f"the inner pytest never started: {(logs / f'{venv.name}.log').read_text()[-2000:]}"
        time.sleep(0.5)  # the marker is written before it is closed
        inner = int(marker.read_text())
        # While it runs, everything it puts in TMPDIR lies in one folder of its own.
        (job_folder,) = scratch.iterdir()
        assert job_folder.name.startswith(f"hybrid-kv-test-{version}.")
        assert [p.name.split(".")[0] for p in job_folder.iterdir()] == ["vllm-cache"]
    finally:
        run.send_signal(signal.SIGTERM)
        try:
            run.wait(timeout=120)
        finally:
            if run.poll() is None:
                run.kill()
            if inner is not None and alive(inner):
                os.kill(inner, signal.SIGKILL)
                assert False, f"the inner pytest ({inner}) outlived the interrupted run"
    assert run.returncode == 130, out.read_text()
    assert sorted(p.name for p in scratch.iterdir()) == []
