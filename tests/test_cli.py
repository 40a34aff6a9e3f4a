"""The ``hybrid-kv`` command's own behaviour: --version, bare help, the exit-code rule, help text,
environment checks in doctor, and vLLM's log lines kept off stdout."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import hybrid_kv_plugin
from hybrid_kv_plugin.cli.main import console_main


def test_version_names_plugin_vllm_and_adapter(adapter, capsys):
    assert console_main(["--version"]) == 0
    assert capsys.readouterr().out == f"hybrid-kv-plugin {hybrid_kv_plugin.__version__} on vLLM {adapter.version} ({adapter.name})\n"


def test_bare_command_prints_help_with_exit_code_rule(capsys):
    assert console_main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hybrid-kv [-h] [--version] {doctor,replay,bench} ...\n")
    assert "exit codes (every subcommand):\n  0  success" in out
    assert "\n  2  invalid input or configuration" in out and "\n  1  failure" in out
    assert "``" not in out  # plain text, not reST


def test_subcommand_help_shows_defaults(capsys):
    assert console_main(["replay", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--seed SEED           seed of the embedded workload (default: 0)" in out
    assert "full-attention block (tokens) (default: 16)" in out
    assert "(default: None)" not in out and "(default: False)" not in out


def test_bad_input_is_one_line_and_exit_2_in_every_subcommand(capsys):
    cases = [
        (["replay", "--scale", "0"], "hybrid-kv: --scale must be >= 1\n"),
        (["bench", "--repeats", "0"], "hybrid-kv: --repeats must be >= 1 and --requests >= 0\n"),
        (["replay", "--gpu-blocks", "0"], "hybrid-kv: --gpu-blocks must be a positive integer\n"),
        (["bench", "--cpu-blocks", "-1"], "hybrid-kv: --cpu-blocks must be a positive integer\n"),
        (["replay", "--compare", "/nonexistent/a.json"],
         "hybrid-kv: --compare /nonexistent/a.json: [Errno 2] No such file or directory: '/nonexistent/a.json'\n"),
    ]
    for argv, stderr in cases:
        assert console_main(argv) == 2, argv
        assert capsys.readouterr().err == stderr
    # Argument errors: one line, no usage (that is --help's), exit 2.
    for argv, stderr in (
        (["doctor", "--jsn"], "hybrid-kv: unrecognized arguments: --jsn (see hybrid-kv --help)\n"),
        (["frobnicate"], "hybrid-kv: argument {doctor,replay,bench}: invalid choice: 'frobnicate' (choose from "
         "'doctor', 'replay', 'bench') (see hybrid-kv --help)\n"),
        (["replay", "--scale", "x"], "hybrid-kv replay: argument --scale: invalid int value: 'x' "
         "(see hybrid-kv replay --help)\n"),
    ):
        assert console_main(argv) == 2, argv
        assert capsys.readouterr().err == stderr


def test_no_option_abbreviations(capsys):
    """`--cpu-block 10` is not --cpu-blocks (argparse's default would take it)."""
    for argv, flag in ((["replay", "--cpu-block", "10"], "--cpu-block"), (["bench", "--repeat", "2"], "--repeat 2")):
        assert console_main(argv) == 2
        assert capsys.readouterr().err == f"hybrid-kv: unrecognized arguments: {flag} (see hybrid-kv --help)\n"


def test_internal_error_is_exit_1(monkeypatch, capsys):
    from hybrid_kv_plugin.cli import doctor

    def broken(**kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(doctor, "run_doctor", broken)
    assert console_main(["doctor"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "hybrid-kv: internal error: RuntimeError: boom (please report it with the output of `hybrid-kv --version`)"
    )


def test_doctor_validates_every_plugin_environment_variable(adapter, monkeypatch, capsys):
    from hybrid_kv_plugin.config import PLUGIN_ENVIRONMENT

    assert sorted(PLUGIN_ENVIRONMENT) == ["HYBRID_KV_MAMBA_SHARED_PREFIX_CHECKPOINT", "HYBRID_KV_PLUGIN_DISABLE"]
    for name in PLUGIN_ENVIRONMENT:
        with monkeypatch.context() as env:
            env.setenv(name, "maybe")
            assert console_main(["doctor"]) == 2, name
            err = capsys.readouterr().err  # doctor's errors: one line each on stderr
            assert f"hybrid-kv doctor: error: environment variable {name}='maybe' (allowed: 1, 0, true, false, yes, no, on, off)\n" in err
            assert console_main(["doctor", "--json"]) == 2
            assert json.loads(capsys.readouterr().out)["environment_errors"] == [
                f"environment variable {name}='maybe' (allowed: 1, 0, true, false, yes, no, on, off)"
            ]
    monkeypatch.setenv("HYBRID_KV_MAMBA_SHARED_PREFIX_CHECKPOINT", "off")
    assert console_main(["doctor", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["environment_errors"] == []


def test_doctor_json_stdout_is_only_json_even_with_vllm_info_logs(adapter):
    """A real process: vLLM configures its logger at import; its lines must go to stderr."""
    env = dict(os.environ, VLLM_LOGGING_LEVEL="INFO")
    env.pop("VLLM_LOGGING_STREAM", None)
    done = subprocess.run(
        [sys.executable, "-m", "hybrid_kv_plugin.cli.main", "doctor", "--json"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert (report["vllm_version"], report["adapter"], report["status"]) == (adapter.version, adapter.name, "active")
