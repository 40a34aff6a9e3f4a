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


# A stand-in for uv (the edge, not the code under test): its first FAILS `uv venv` calls fail
# as uv 0.13.9 does when a concurrent install loses a cache file; later ones make a bare venv,
# and every `uv pip install` succeeds without installing anything.
FLAKY_UV = """\
#!/usr/bin/env bash
echo "$*" >>"$FAKE_UV_CALLS"
if [[ "$1" == venv ]]; then
    tries=$(grep -c '^venv ' "$FAKE_UV_CALLS")
    if ((tries <= FAKE_UV_FAILS)); then
        echo "error: Failed to write to the client cache" >&2
        echo "  cause: failed to rename file from .tmpX to pypi/x.rkyv: No such file or directory (os error 2)" >&2
        exit 2
    fi
    exec "$FAKE_UV_PYTHON" -m venv --without-pip "${@: -1}"
fi
"""


def _setup_with_flaky_uv(tmp_path: Path, failures: int) -> tuple[subprocess.CompletedProcess, list[str], Path]:
    tools, venvs, logs, scratch = (tmp_path / name for name in ("bin", "venvs", "logs", "tmp"))
    for folder in (tools, venvs, logs, scratch):
        folder.mkdir()
    (tools / "uv").write_text(FLAKY_UV)
    (tools / "uv").chmod(0o755)
    calls = tmp_path / "uv-calls.txt"
    calls.touch()
    env = dict(
        os.environ,
        PATH=f"{tools}{os.pathsep}{os.environ['PATH']}",
        TMPDIR=str(scratch),
        HYBRID_KV_VENV_ROOT=str(venvs),
        HYBRID_KV_LOG_DIR=str(logs),
        HYBRID_KV_FIND_LINKS=str(tmp_path),  # one install command, no index
        FAKE_UV_CALLS=str(calls),
        FAKE_UV_FAILS=str(failures),
        FAKE_UV_PYTHON=sys.executable,
    )
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "test"), "--setup-only", "0.33.0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert sorted(scratch.iterdir()) == []
    return run, calls.read_text().splitlines(), venvs / "vllm-0.33.0"


def test_a_venv_build_that_loses_a_uv_cache_race_is_retried(tmp_path):
    run, calls, venv = _setup_with_flaky_uv(tmp_path, failures=2)
    assert run.returncode == 0, run.stdout + run.stderr
    assert [c.split()[0] for c in calls if c.startswith("venv ")] == ["venv"] * 3
    assert run.stdout.count("vllm 0.33.0: venv install failed (try ") == 2
    assert "vllm 0.33.0: venv install failed (try 2 of 3" in run.stdout
    assert (venv / ".hybrid-kv-stamp").is_file() and (venv / ".hybrid-kv-plugin-stamp").is_file()


def test_a_venv_build_that_fails_three_times_fails_its_wheel_and_leaves_no_venv(tmp_path):
    run, calls, venv = _setup_with_flaky_uv(tmp_path, failures=3)
    assert run.returncode == 1, run.stdout + run.stderr
    assert len([c for c in calls if c.startswith("venv ")]) == 3
    assert "venv install failed (3 tries)" in run.stdout
    assert not venv.exists()
