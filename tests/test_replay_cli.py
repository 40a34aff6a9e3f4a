"""``hybrid-kv replay``'s inputs and report, through the command: requests vLLM would refuse,
the serve line checked as doctor checks it, pools cut to what a trace can take, the next step
when the unit equals the Mamba block, start-up apart from each configuration, and progress per
configuration. Bad input: one line on stderr, exit 2."""

from __future__ import annotations

import json

from hybrid_kv_plugin.cli.serve_args import check_serve_args
from hybrid_kv_plugin.sim.geometry import data_dir
from hybrid_kv_plugin.sim.pool_bound import blocks_a_workload_can_take
from hybrid_kv_plugin.sim.configs import CONFIGS
from hybrid_kv_plugin.sim.replay import ReplaySettings, replay
from hybrid_kv_plugin.sim.workload import default_workload

from scenarios.mooncake_trace import mooncake_line, run_replay, write_trace

QWEN3_NEXT = data_dir("qwen3-next-80b-a3b-instruct")
TINY = data_dir("tiny-qwen3-next")


# ---------------------------------------------------------------------------- refused requests
def test_an_over_long_prompt_is_refused_and_the_replay_goes_on(tmp_path, capsys):
    trace = write_trace(tmp_path, [mooncake_line(0, 700, 5, [1, 2]), mooncake_line(5, 300_000, 1, list(range(10, 596))), mooncake_line(9, 760, 3, [1, 3])])
    code, out, _ = run_replay(capsys, "--trace", trace, "--configs", "stock", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["refused_requests"] == {"prompt_too_long": 1}
    assert [r["requests"] for r in report["results"]] == [2]
    code, out, _ = run_replay(capsys, "--trace", trace, "--configs", "stock")
    assert code == 0
    assert (
        "refused: 1 request(s) vLLM would answer with an error (max model length 262144), left out: prompt too long: 1\n"
        in out
    )


def test_strict_stops_at_the_first_refused_request(tmp_path, capsys):
    trace = write_trace(tmp_path, [mooncake_line(0, 700, 5, [1, 2]), mooncake_line(5, 300_000, 1, list(range(10, 596)))])
    code, out, err = run_replay(capsys, "--trace", trace, "--strict")
    assert (code, out) == (2, "")
    assert err == (
        "hybrid-kv: request mc1: prompt of 300000 tokens does not fit the model's max model length 262144 "
        "(without --strict it is counted as refused)\n"
    )


def test_prompt_plus_output_past_the_model_length_is_refused(tmp_path, capsys):
    trace = write_trace(tmp_path, [mooncake_line(0, 700, 5, [1, 2]), mooncake_line(5, 262_000, 500, list(range(10, 522)))])
    code, out, _ = run_replay(capsys, "--trace", trace, "--configs", "stock", "--json")
    assert code == 0
    assert json.loads(out)["refused_requests"] == {"prompt_plus_output_too_long": 1}


# ---------------------------------------------------------------------------- the serve line
def _serve_line_case(tmp_path, capsys, adapter, config):
    line = [QWEN3_NEXT, "--additional-config", config]
    code, out, err = run_replay(capsys, "--trace", write_trace(tmp_path, [mooncake_line(0, 700, 5, [1, 2])]), "--", *line)
    errors = check_serve_args(line, adapter).errors  # what doctor reports for the same line
    assert (code, out) == (2, "")
    assert err == f"hybrid-kv: invalid vllm serve line: {'; '.join(errors)}\n"
    return errors


def test_broken_additional_config_is_refused_as_doctor_refuses_it(tmp_path, capsys, adapter):
    errors = _serve_line_case(tmp_path, capsys, adapter, '{"hybrid_kv": {bad')
    assert errors[0].startswith("--additional-config: not valid JSON (Expecting property name")


def test_unknown_hybrid_kv_key_is_refused_as_doctor_refuses_it(tmp_path, capsys, adapter):
    errors = _serve_line_case(tmp_path, capsys, adapter, '{"hybrid_kv": {"prompt_tail": "both"}}')
    assert len(errors) == 1 and errors[0].startswith(
        "--additional-config: invalid hybrid-kv-plugin configuration: hybrid_kv.prompt_tail: unknown key "
        "(allowed keys: async_load_liveness, "
    )


def test_unknown_key_in_a_native_trace_names_its_line(tmp_path, capsys):
    trace = write_trace(tmp_path, ['{"tokens": [1, 2, 3]}', '{"tokens": [1, 2, 4], "max_token": 4}'])
    code, out, err = run_replay(capsys, "--trace", trace)
    assert (code, out) == (2, "")
    assert err.startswith(f"hybrid-kv: --trace {trace}: trace line 2: unknown key(s) 'max_token' (allowed: ")
    assert err.count("\n") == 1


# ---------------------------------------------------------------------------- report figures
def test_progress_per_configuration_and_start_up_apart(tmp_path, capsys):
    trace = write_trace(tmp_path, [mooncake_line(0, 700, 5, [1, 2])])
    code, out, err = run_replay(capsys, "--trace", trace, "--configs", "stock,plugin")
    assert code == 0
    progress = [line for line in err.splitlines() if " requests (" in line]
    assert [line.split(",")[0] for line in progress] == [
        "stock [1/2]: 1/1 requests (100%)",
        "plugin [2/2]: 1/1 requests (100%)",
    ]
    assert "  (wall s is each configuration's own run; start-up before the first: " in out
    code, out, _ = run_replay(capsys, "--trace", trace, "--configs", "stock", "--json")
    report = json.loads(out)
    assert report["startup_s"] >= 0 and set(report["results"][0]["timing"]) >= {"wall_s", "peak_rss_mib"}


def test_next_step_when_the_unit_equals_the_mamba_block(tmp_path, capsys):
    trace = write_trace(tmp_path, [mooncake_line(0, 700, 5, [1, 2])])
    code, out, _ = run_replay(capsys, "--trace", trace, "--configs", "stock", "--", QWEN3_NEXT)
    assert code == 0
    assert (
        "next step: the prefix-match unit equals the Mamba block (544 tokens): every hit is whole Mamba blocks, "
        "where stock vLLM already keeps every state, so the plugin cannot add anything; --prefix-match-unit 16 is "
        "the finest unit vLLM accepts for this geometry: prefix hits every 16 tokens instead of every 544"
    ) in out
    code, out, _ = run_replay(capsys, "--trace", trace, "--configs", "stock", "--json", "--", QWEN3_NEXT, "--prefix-match-unit", "16")
    assert code == 0 and "next_steps" not in json.loads(out)


def test_absurd_block_count_is_capped_with_a_warning(tmp_path, capsys):
    """The shipped tiny model at the default 40 GiB resolves to 10,485,760 GPU blocks of 4 KiB."""
    trace = write_trace(tmp_path, [mooncake_line(0, 700, 5, [1, 2]), mooncake_line(9, 760, 3, [1, 3])])
    code, out, err = run_replay(capsys, "--trace", trace, "--configs", "stock", "--json", "--model", TINY)
    assert code == 0
    report = json.loads(out)
    assert report["model_geometry"]["gpu_blocks"] == 10_485_760
    # Per request and group: tokens (prompt + output + 1 look-ahead + 1) in 32-token blocks,
    # one per chunk, two spare; four groups (attention and the model's three Mamba groups); one null
    # block: 4*(23+1+2) + 4*(24+1+2) + 1.
    assert (report["settings"]["gpu_blocks"], report["settings"]["cpu_blocks"]) == (213, 213)
    assert (
        "hybrid-kv: warning: this geometry makes 10485760 GPU blocks of 4096 bytes at 40 GiB (a toy model at a "
        "server's memory?); replayed as 213, all this trace can take, with the same result; --gpu-kv-gib sets the memory\n"
    ) in err


def test_a_pool_cut_to_what_the_workload_can_take_replays_the_same():
    """The pool bound's claim: no block is evicted at the bound, so the result equals a 4x larger pool."""
    segments = default_workload(seed=0)
    base = ReplaySettings(cpu_blocks=1 << 16)
    bound = blocks_a_workload_can_take(
        segments, attention_block_size=base.attention_block_size, mamba_block_size=base.mamba_block_size,
        max_num_batched_tokens=base.max_num_batched_tokens,
    )
    assert bound == 1651
    small = replay(segments, ReplaySettings(gpu_blocks=bound, cpu_blocks=bound), CONFIGS["plugin"])
    large = replay(segments, ReplaySettings(gpu_blocks=4 * bound, cpu_blocks=4 * bound), CONFIGS["plugin"])
    assert small.summary() == large.summary()


def test_the_cli_names_every_replay_configuration():
    """The CLI's light list (help text, --configs) stays the simulator's table, in its order."""
    from hybrid_kv_plugin.cli.args import CONFIG_NAMES
    from hybrid_kv_plugin.sim.configs import CONFIGS

    assert CONFIG_NAMES == tuple(CONFIGS)


def test_the_help_names_the_default_configurations_a_run_uses(capsys):
    """``replay --help`` states the configurations a run without ``--configs`` replays (it once said
    ``stock,plugin`` while the run replayed stock at its best too)."""
    from hybrid_kv_plugin.cli.args import choose_configs
    from hybrid_kv_plugin.cli.main import console_main

    assert console_main(["replay", "--help"]) == 0
    help_text = "".join(capsys.readouterr().out.split())  # argparse wraps (also after hyphens)
    default = ",".join(c.name for c in choose_configs(None, ()))
    assert default == (
        "stock,stock+retain-0,stock+retain-unit,stock+retain-block,stock+shared-prefix,plugin,plugin+divergence"
    )
    assert f"(default:{default},plusplugin+junctionwhenasegmentrunsEAGLE;" in help_text
