"""``hybrid-kv replay`` at production length, on a real model's geometry, and its bad inputs.

The long prompts run on the Qwen3-Next-80B-A3B geometry the wheel resolves (544-token
blocks); the bad-input table goes through the CLI entry point: one line on stderr, exit 2,
no traceback, nothing on stdout.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybrid_kv_plugin.cli.main import console_main, main
from hybrid_kv_plugin.cli.replay_inputs import MODEL_GEOMETRY_FIELDS, settings_for_model
from hybrid_kv_plugin.sim.geometry import data_dir
from hybrid_kv_plugin.models.geometry import ServeLine, resolve
from hybrid_kv_plugin.sim.mooncake import load_mooncake
from hybrid_kv_plugin.sim.configs import CONFIGS
from hybrid_kv_plugin.sim.replay import ReplaySettings, replay
from hybrid_kv_plugin.adapters.detect import installed_vllm
from hybrid_kv_plugin.registration import current_adapter

from scenarios.mooncake_trace import mooncake_line

QWEN3_NEXT = data_dir("qwen3-next-80b-a3b-instruct")
NEMOTRON_H = data_dir("nemotron-nano-9b-v2")
SAMPLE = Path(__file__).parent / "data" / "mooncake_sample.jsonl"
SRC = Path(__file__).resolve().parent.parent / "src"


@pytest.fixture(scope="module")
def qwen_settings():
    geometry = resolve(ServeLine(model=QWEN3_NEXT))

    class Args:
        pass

    args = Args()
    for name in MODEL_GEOMETRY_FIELDS:
        setattr(args, name, getattr(ReplaySettings, name))
    return settings_for_model(ReplaySettings(), geometry, args)


# Align mode trims each prefill chunk of the 8192-token budget to whole 544-token blocks (8160),
# and a Mamba state is kept where a chunk ends: a hit can only end on a multiple of 8160.
CHUNK = 8192 // 544 * 544
# Measured: stock 0.26.0 with a connector serves every whole attention block (hits reach the
# ideal) although the Mamba state exists only where a prefill chunk ended - the wrong-state bug
# patch connector_hit_reconcile fixes; with the plugin, and on 0.27.1+, hits end on chunk ends.
STOCK_SERVES_WHOLE_BLOCKS = installed_vllm().raw == "0.26.0"


@pytest.mark.parametrize(
    ("blocks", "shared"),
    [
        (32, 24),  # 16,384-token prompts sharing 12,288 tokens: ideal 22 blocks, reused one chunk
        (256, 200),  # 131,072-token prompts sharing 102,400 tokens: ideal 188 blocks, reused 12 chunks
    ],
)
@pytest.mark.parametrize("config", ["stock", "plugin"])
def test_long_prompt_replays_on_the_qwen3_next_geometry(qwen_settings, blocks, shared, config):
    first = list(range(blocks))
    second = first[:shared] + list(range(10_000, 10_000 + blocks - shared))
    (segment,) = load_mooncake([mooncake_line(0, blocks * 512, 3, first), mooncake_line(5000, blocks * 512, 3, second)])
    result = replay([segment], qwen_settings, CONFIGS[config])
    assert result.refused is None
    prompt = blocks * 512
    ideal = shared * 512 // 544 * 544
    reused = ideal if STOCK_SERVES_WHOLE_BLOCKS and config == "stock" else shared * 512 // CHUNK * CHUNK
    assert result.prompt_tokens == 2 * prompt
    assert result.ideal_tokens == ideal
    assert (result.reused_gpu_tokens, result.reused_cpu_tokens) == (reused, 0)
    # Stock 0.27-0.28 publish no hand-offs: the attribution counts lost whole Mamba blocks as
    # dropped hand-offs there (see sim/attribution.py); everywhere else they have no state.
    inferred = config == "stock" and not current_adapter().has_boundary_handoffs
    assert result.loss["handoff_dropped" if inferred else "no_mamba_state"] == ideal - reused
    (seg,) = result.segments
    # Each arrives to an idle engine; its first token comes with its last prefill chunk. The
    # second takes one step more than its remaining chunks (measured on 0.27-0.33 and stock 0.26);
    # 0.26 with connector_hit_reconcile measured without that step (not investigated further).
    extra_step = 0 if STOCK_SERVES_WHOLE_BLOCKS and config == "plugin" else 1
    assert seg.ttft_steps == {"mc0": -(-prompt // CHUNK) - 1, "mc1": -(-(prompt - reused) // CHUNK) - 1 + extra_step}


def test_sample_trace_replays_with_exact_hits(qwen_settings):
    with SAMPLE.open() as handle:
        segments = load_mooncake(handle)
    stock = replay(segments, qwen_settings, CONFIGS["stock"])
    plugin = replay(segments, qwen_settings, CONFIGS["plugin"])
    assert stock.prompt_tokens == plugin.prompt_tokens == 699_413
    assert stock.ideal_tokens == plugin.ideal_tokens == 28_832
    # Stock and plugin reuse the same (the unit equals the 544-token block), up to chunk ends; stock
    # 0.26 serves whole blocks without their Mamba state (see STOCK_SERVES_WHOLE_BLOCKS).
    expected = (24_480, 0)
    assert (stock.reused_gpu_tokens, stock.reused_cpu_tokens) == ((28_832, 0) if STOCK_SERVES_WHOLE_BLOCKS else expected)
    assert (plugin.reused_gpu_tokens, plugin.reused_cpu_tokens) == expected


# ---------------------------------------------------------------------------- bad input
def _write(tmp_path, *lines):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


BAD_INPUTS = [
    (lambda p: ["replay", "--trace", _write(p, '{"timestamp": 0, "input_length": 5, "output_length": 1, '
                                             '"hash_ids": [1], "priority": 1}')],
     "trace line 1: unknown key(s) 'priority' for a Mooncake line (allowed: hash_ids, input_length, "
     "output_length, timestamp)"),
    (lambda p: ["replay", "--trace", _write(p, mooncake_line(0, 5, 1, [1]), mooncake_line(1, 0, 1, []))],
     "trace line 2: input_length must be > 0, got 0"),
    (lambda p: ["replay", "--trace", _write(p, mooncake_line(0, 5, -3, [1]))],
     "trace line 1: output_length must be > 0, got -3"),
    (lambda p: ["replay", "--trace", _write(p, mooncake_line(0, 5, 1, [1]), '{"tokens": [1, 2, 3]}')],
     "trace line 2: not a Mooncake line (the file mixes formats: its first line is Mooncake)"),
    (lambda p: ["replay", "--trace", _write(p, '{"tokens": [1, 2, 3]}', mooncake_line(0, 5, 1, [1]))],
     "trace line 2: a Mooncake line in a trace in the project's format (the file mixes formats)"),
    (lambda p: ["replay", "--trace", _write(p, "{not json")], "trace line 1: not JSON"),
    (lambda p: ["replay", "--trace", _write(p, mooncake_line(0, 300_000, 1, list(range(586))))],
     "every request is refused by vLLM (prompt_too_long: 1): nothing to replay"),
    (lambda p: ["replay", "--strict", "--trace", _write(p, mooncake_line(0, 300_000, 1, list(range(586))))],
     "request mc0: prompt of 300000 tokens does not fit the model's max model length 262144"),
    (lambda p: ["replay", "--trace", _write(p, '{"tokens": [1, 2]}', '{"tokens": [1], "max_token": 3}')],
     "trace line 2: unknown key(s) 'max_token' (allowed: "),
    (lambda p: ["replay", "--cpu-block", "10"], "hybrid-kv: unrecognized arguments: --cpu-block"),
    (lambda p: ["replay", "--per-request"], "hybrid-kv: --per-request needs --json"),
    (lambda p: ["replay", "--limit", "0", "--trace", "x.jsonl"], "hybrid-kv: --limit must be >= 1, got 0"),
    (lambda p: ["replay", "--trace", str(p / "missing.jsonl")], "cannot read --trace"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_INPUTS)
def test_bad_input_is_one_line_and_exit_2_without_vllm(tmp_path, argv, message):
    """Run in a fresh interpreter: the refusal must come before vLLM is imported."""
    code = (
        "import sys\n"
        "from hybrid_kv_plugin.cli.main import console_main\n"
        f"rc = console_main({argv(tmp_path)!r})\n"
        "sys.stderr.write('vllm imported: %s\\n' % ('vllm' in sys.modules))\n"
        "sys.exit(rc)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 2 and lines[1] == "vllm imported: False", done.stderr
    assert message in lines[0] and lines[0].startswith("hybrid-kv: ")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", NEMOTRON_H], "hybrid-kv: every request is refused by vLLM (prompt_too_long: 1): nothing to replay"),
        (["--strict", "--model", NEMOTRON_H],
         "request mc0: prompt of 140000 tokens does not fit the model's max model length 131072"),
        (["--", QWEN3_NEXT, "--prefix-match-unit", "7"], "hybrid-kv: invalid vllm serve line: vLLM refuses this geometry: Invalid prefix_match_unit=7"),
        (["--model", QWEN3_NEXT, "--attention-block-size", "32"],
         "hybrid-kv: --attention-block-size conflict(s) with the model's resolved geometry"),
        # Equal to the replay's default (16) and still refused: the model's unit (544) would replace it unseen.
        (["--model", QWEN3_NEXT, "--prefix-match-unit", "16"],
         "hybrid-kv: --prefix-match-unit conflict(s) with the model's resolved geometry"),
        (["--model", QWEN3_NEXT, "--cpu-blocks", "8192", "--gpu-blocks", "1024"],
         "hybrid-kv: --gpu-blocks, --cpu-blocks conflict(s) with the model's resolved geometry"),
    ],
)
def test_bad_model_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    trace = _write(tmp_path, mooncake_line(0, 140_000, 1, list(range(274))))
    assert console_main(["replay", "--trace", trace, *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    # vLLM's own import-time warnings (e.g. "Triton not available") may precede it when this test runs first.
    ours = [line for line in err.splitlines() if line.startswith("hybrid-kv")]
    assert len(ours) == 1 and message in ours[0] and err.endswith(ours[0] + "\n"), err
    assert "Traceback" not in err and "must divide --block-size 16" not in err


# ---------------------------------------------------------------------------- nothing left behind
def _replay_process(tmp: Path, *argv: str) -> tuple[list[str], dict[str, str]]:
    """``hybrid-kv replay ARGV`` as a process of its own, with ``tmp`` as its TMPDIR."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CACHE_ROOT"}
    env.update(TMPDIR=str(tmp), PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return [sys.executable, "-m", "hybrid_kv_plugin.cli.main", "replay", *argv], env


def test_replay_leaves_no_temp_dir_and_only_the_report_on_stdout(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    argv, env = _replay_process(tmp, "--trace", str(SAMPLE), "--limit", "3", "--configs", "stock", "--json",
                                "--model", QWEN3_NEXT)
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)  # stdout is the report and nothing else
    assert report["model_geometry"]["attention_block_size"] == 544
    assert [r["requests"] for r in report["results"]] == [3]
    assert list(tmp.iterdir()) == []


def _processes_under(tmp: Path) -> list[int]:
    """Processes whose TMPDIR is ``tmp`` or lies inside it: a replay run there and its children."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                variables = environ.read().split(b"\0")
        except (OSError, ValueError):
            continue
        if any(v == f"TMPDIR={tmp}".encode() or v.startswith(f"TMPDIR={tmp}/".encode()) for v in variables):
            found.append(int(entry))
    return found


def _wait_until_gone(tmp: Path, seconds: float = 30.0) -> list[int]:
    import time

    deadline = time.monotonic() + seconds
    while (left := _processes_under(tmp)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_replay_jobs_without_a_model_leave_no_temp_dir(tmp_path):
    """Each ``--jobs`` child used to make its own vLLM cache dir (no --model: the parent had made
    none), and a pool worker never runs the atexit that removes it."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    argv, env = _replay_process(tmp, "--configs", "stock,plugin", "--jobs", "2", "--json")
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert [r["name"] for r in report["results"]] == ["stock", "plugin"]
    assert _wait_until_gone(tmp) == []
    assert list(tmp.iterdir()) == []


def test_sigterm_stops_the_replay_children_and_leaves_no_temp_dir(tmp_path):
    """``kill`` (a job's time limit) of a ``--jobs 2`` replay while both children replay, and a
    second one while it cleans up (``timeout`` passes on a kill sent to both): exit 143 at once,
    one line, no worker left running, nothing left in TMPDIR."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    # Long enough (minutes) that both configurations are mid-run when the signal comes.
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(
        mooncake_line(i * 100, 1500, 50, [i % 7, 1000 + i, 2000 + i]) + "\n" for i in range(3000)
    ))
    argv, env = _replay_process(tmp, "--trace", str(trace), "--configs", "stock,plugin", "--jobs", "2",
                                "--model", QWEN3_NEXT)
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        started = set()
        for line in proc.stderr:  # each child's first progress line names its configuration
            started |= {label for label in ("[1/2]", "[2/2]") if label in line}
            if len(started) == 2:
                break
        assert started == {"[1/2]", "[2/2]"}
        assert len(_processes_under(tmp)) >= 3  # this replay, its two workers (and multiprocessing's tracker)
        proc.terminate()
        time.sleep(0.5)
        proc.terminate()  # before the fix: killed by this one (-15) while cleaning up
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # orphaned workers still hold stderr open
            err = "stderr still open 120 s after SIGTERM"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        left = _wait_until_gone(tmp, seconds=10)
        for pid in left:  # a failed run's orphans must not outlive the test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 143
    assert left == []
    assert "hybrid-kv: terminated\n" in err and "Traceback" not in err, err[-2000:]
    assert list(tmp.iterdir()) == []
