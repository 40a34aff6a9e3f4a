"""``python -m soak`` (tests/soak): a short run and a sweep work and leave nothing in the temp dir they were given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _soak_output(tmp_path, *args: str, hash_seed: str | None = "0") -> list[str]:
    """The stdout lines of ``python -m soak ARGS``, checked to exit 0 and to leave nothing in the temp dir it
    was given (``hash_seed``: the caller's PYTHONHASHSEED, None for none)."""
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
    # torch's compile cache (torchinductor_<user>) and vLLM's cache went here before the private root.
    assert sorted(p.name for p in scratch.iterdir()) == []
    return done.stdout.splitlines()


def _soak(tmp_path, *args: str, hash_seed: str | None = "0") -> str:
    """The one summary line of a single run of ``python -m soak ARGS`` (see :func:`_soak_output`)."""
    lines = _soak_output(tmp_path, *args, hash_seed=hash_seed)
    summary = [line for line in lines if line.startswith("soak vllm ")]
    assert len(summary) == 1 and not any(line.startswith("soak sweep ") for line in lines), lines[-20:]
    return summary[0]


def _counts(line: str) -> dict[str, str]:
    """The ``name=value`` figures of a run's summary line, before its ``|``."""
    return dict(item.split("=", 1) for item in line.split("|")[0].split() if "=" in item)


def test_the_soak_runs_under_async_scheduling_on_request(tmp_path):
    # The same program, stepped by the async engine core.
    sync = _soak(tmp_path / "sync", "--variant", "plugin", "--steps", "300")
    asynchronous = _soak(tmp_path / "async", "--variant", "plugin", "--steps", "300", "--async-scheduling")
    assert " violations=0 " in sync and " violations=0 " in asynchronous
    counts = [_counts(line) for line in (sync, asynchronous)]
    # The same 34 arrivals, stepped differently (0.33.0: 303 steps and 2 byte-checked loads sync, 300 and 6 async).
    assert counts[0]["requests"] == counts[1]["requests"] and counts[0] != counts[1]


def test_a_seed_names_one_run_whatever_the_callers_hash_seed(tmp_path):
    # Without PYTHONHASHSEED the command fixes 0 (set order moves steps), as the suite does;
    # a caller's own value is kept and named.
    # (The summary reads the variable in the process that ran the steps.)
    unset = _soak(tmp_path / "unset", "--variant", "plugin", "--steps", "20", hash_seed=None)
    one = _soak(tmp_path / "one", "--variant", "plugin", "--steps", "20", hash_seed="1")
    assert "; PYTHONHASHSEED=0; " in unset and "; PYTHONHASHSEED=1; " in one


def test_a_sweep_runs_each_seed_under_both_schedulers_as_alone(tmp_path, plugin, adapter):
    from hybrid_kv_plugin.sim.engine import default_scheduling
    from soak.harness import soak, variants

    out = _soak_output(tmp_path, "--variant", "plugin", "--steps", "60", "--seed", "3-4", "--both-schedulers")
    runs = [line for line in out if line.startswith("soak vllm ")]
    assert [line.split("(")[1].split("; PYTHONHASHSEED")[0] for line in runs] == [
        "seed 3; Scheduler", "seed 3; AsyncScheduler", "seed 4; Scheduler", "seed 4; AsyncScheduler"
    ]
    counts = [_counts(line) for line in runs]
    totals = [line for line in out if line.startswith("soak sweep vllm ")]
    loads = sum(int(c["byte_checked_loads"]) for c in counts)
    assert totals == [
        f"soak sweep vllm {adapter.version}: runs=4 violating=0 crashed=0 byte_checked_loads={loads} byte_violations=0"
    ]
    # The last run of the sweep, after three others in its process, is the run alone in this one.
    with default_scheduling(True):
        alone, checks, violations = soak(adapter, next(v for v in variants(adapter) if v.name == "plugin"), 60, 4)
    assert violations == []
    last = counts[3]
    assert (last["steps"], last["requests"], last["invariant_checks"], last["byte_checked_loads"]) == (
        str(alone.steps), str(alone.requests), str(checks), str(alone.byte_checked_loads)
    )


def test_a_sweep_reports_a_crashed_run_and_goes_on(plugin, adapter, monkeypatch, capsys):
    from soak import harness

    real = harness.soak

    def crashes_on_seed_1(adapter, variant, steps, seed, plugin_options=None):
        if seed == 1:
            raise RuntimeError("injected at seed 1")
        return real(adapter, variant, steps, seed, plugin_options)

    monkeypatch.setattr(harness, "soak", crashes_on_seed_1)
    assert harness.main(["--variant", "plugin", "--steps", "20", "--seed", "0-2"]) == 1
    out = capsys.readouterr().out.splitlines()
    runs = [line for line in out if line.startswith("soak vllm ")]
    assert len(runs) == 3
    crash = f"soak vllm {adapter.version} plugin: crashed (seed 1; Scheduler): RuntimeError('injected at seed 1')"
    assert runs[1] == crash
    # The runs before and after it ran to the end, clean.
    assert [(" violations=0 " in line, line.split("(")[1].split(";")[0]) for line in (runs[0], runs[2])] == [
        (True, "seed 0"), (True, "seed 2")
    ]
    assert [line.split(" runs=")[1].split(" byte_checked")[0] for line in out if line.startswith("soak sweep ")] == [
        "3 violating=0 crashed=1"
    ]


def test_an_empty_range_of_seeds_is_refused(capsys):
    from soak import harness

    with pytest.raises(SystemExit) as stopped:
        harness.main(["--seed", "5-3"])
    assert stopped.value.code == 2
    assert "argument --seed: empty range of seeds: '5-3' (FROM must not exceed TO)" in capsys.readouterr().err
