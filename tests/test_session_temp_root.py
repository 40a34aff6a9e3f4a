"""The test session's private temp root (tests/conftest.py) goes even when pytest stops before a
session starts, e.g. on a usage error: conftest.py makes it at import."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_pytest_usage_error_leaves_no_temp_root(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--no-such-option", "tests/test_bench.py"],
        cwd=ROOT, env=dict(os.environ, TMPDIR=str(scratch)), capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 4, done.stdout[-2000:] + done.stderr[-2000:]
    assert "unrecognized arguments: --no-such-option" in done.stderr
    assert sorted(p.name for p in scratch.iterdir()) == []


WAITING_TEST = '''
import os
import time


def test_waits_to_be_stopped():
    open(os.environ["HYBRID_KV_STARTED"], "w").close()
    time.sleep(120)
'''


def test_a_run_stopped_by_sigterm_leaves_no_temp_root(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    started = tmp_path / "started"
    (tmp_path / "test_waiting.py").write_text(WAITING_TEST)
    env = dict(os.environ, TMPDIR=str(scratch), HYBRID_KV_STARTED=str(started), PYTHONPATH=str(ROOT / "tests"))
    child = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "conftest", "-q", "test_waiting.py"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not started.exists():
            assert child.poll() is None and time.monotonic() < deadline, child.communicate()[0][-3000:]
            time.sleep(0.1)
        assert sorted(p.name for p in scratch.iterdir()) != []  # the session's root is there while it runs
        child.send_signal(signal.SIGTERM)
        output = child.communicate(timeout=120)[0]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 2, output[-3000:]  # pytest's "interrupted"
    assert "KeyboardInterrupt" in output
    assert sorted(p.name for p in scratch.iterdir()) == []
