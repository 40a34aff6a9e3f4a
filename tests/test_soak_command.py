"""``python -m soak`` (tests/soak): a short run works and leaves nothing in the temp dir it was given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_short_soak_run_leaves_nothing_behind(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = dict(os.environ, TMPDIR=str(scratch), PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT / "src")]))
    env.pop("VLLM_CACHE_ROOT", None)
    done = subprocess.run(
        [sys.executable, "-m", "soak", "--variant", "plugin", "--steps", "20"],
        cwd=ROOT / "tests", env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = [line for line in done.stdout.splitlines() if line.startswith("soak vllm ")]
    assert len(summary) == 1 and " plugin: " in summary[0] and " violations=0 " in summary[0], done.stdout[-2000:]
    # torch's compile cache (torchinductor_<user>) and vLLM's cache went here before the private root.
    assert sorted(p.name for p in scratch.iterdir()) == []
