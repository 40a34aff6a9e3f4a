"""``python -m soak`` (tests/soak): a short run works and leaves nothing in the temp dir it was given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _soak(tmp_path, *args: str, hash_seed: str | None = "0") -> str:
    """The summary line of ``python -m soak ARGS``, checked to leave nothing in the temp dir it was given
    (``hash_seed``: the caller's PYTHONHASHSEED, None for none)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir(parents=True)
    env = dict(os.environ, TMPDIR=str(scratch), PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT / "src")]))
    env.pop("VLLM_CACHE_ROOT", None)
    env.pop("PYTHONHASHSEED", None)
    if hash_seed is not None:
        env["PYTHONHASHSEED"] = hash_seed
    done = subprocess.run(
        [sys.executable, "-m", "soak", *args], cwd=ROOT / "tests", env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = [line for line in done.stdout.splitlines() if line.startswith("soak vllm ")]
    assert len(summary) == 1, done.stdout[-2000:]
    # torch's compile cache (torchinductor_<user>) and vLLM's cache went here before the private root.
    assert sorted(p.name for p in scratch.iterdir()) == []
    return summary[0]


def test_a_short_soak_run_leaves_nothing_behind(tmp_path):
    summary = _soak(tmp_path, "--variant", "plugin", "--steps", "20")
    assert " plugin: " in summary and " violations=0 " in summary


def test_the_soak_runs_under_async_scheduling_on_request(tmp_path):
    # The same program, stepped by the async engine core.
    sync = _soak(tmp_path / "sync", "--variant", "plugin", "--steps", "300")
    asynchronous = _soak(tmp_path / "async", "--variant", "plugin", "--steps", "300", "--async-scheduling")
    assert " violations=0 " in sync and " violations=0 " in asynchronous
    counts = [dict(item.split("=", 1) for item in line.split("|")[0].split() if "=" in item) for line in (sync, asynchronous)]
    # The same 34 arrivals, stepped differently (0.33.0: 303 steps and 2 byte-checked loads sync, 300 and 6 async).
    assert counts[0]["requests"] == counts[1]["requests"] and counts[0] != counts[1]


def test_a_seed_names_one_run_whatever_the_callers_hash_seed(tmp_path):
    # Without PYTHONHASHSEED the command fixes 0 (set order moves steps), as the suite does;
    # a caller's own value is kept and named.
    # (The summary reads the variable in the process that ran the steps.)
    unset = _soak(tmp_path / "unset", "--variant", "plugin", "--steps", "20", hash_seed=None)
    one = _soak(tmp_path / "one", "--variant", "plugin", "--steps", "20", hash_seed="1")
    assert "(PYTHONHASHSEED=0; " in unset and "(PYTHONHASHSEED=1; " in one
