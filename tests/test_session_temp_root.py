"""The test session's private temp root (tests/conftest.py) goes even when pytest stops before a
session starts, e.g. on a usage error: conftest.py makes it at import."""

from __future__ import annotations

import os
import subprocess
import sys
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
