"""``hybrid-kv doctor`` prints the capability table of the installed wheel."""

from __future__ import annotations

import io
import json

import pytest

from hybrid_kv_plugin.cli.main import console_main, main
from hybrid_kv_plugin.patches import patch_specs

from helpers import CAPABILITY_TABLE


def test_doctor_table_matches_adapter(adapter, capsys, monkeypatch):
    monkeypatch.delenv("HYBRID_KV_PLUGIN_DISABLE", raising=False)
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["vllm_version"] == adapter.version
    assert report["adapter"] == adapter.name
    assert report["status"] == "active"
    verdicts = {f["feature"]: f["support"] for f in report["features"]}
    supports = tuple(verdicts[k] for k in ("fine_grained_cpu_hits", "mamba_shared_prefix_checkpoint", "nixl_ssm_slot_pairing"))
    assert supports == tuple(s.value for s in CAPABILITY_TABLE[adapter.version])
    # The plugin's own options: their patches go in from 0.29 on; async_load_liveness's landing
    # reservation on every wheel (its failed-load half from 0.29).
    opt_in = "plugin" if adapter.version >= "0.29" else "unavailable"
    for key in ("prompt_tail_checkpoint", "mamba_output_checkpoint", "mamba_divergence_checkpoint"):
        assert verdicts[key] == opt_in
    assert verdicts["async_load_liveness"] == "plugin"
    assert [p["name"] for p in report["patches"]] == [s.name for s in patch_specs(adapter)]


def test_doctor_table_lists_every_feature_and_option(adapter, capsys):
    from hybrid_kv_plugin.config import ConnectorOptions, PluginConfig

    assert main(["doctor", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["features"]
    assert [r["feature"] for r in rows] == [
        "fine_grained_cpu_hits",
        "mamba_shared_prefix_checkpoint",
        "nixl_ssm_slot_pairing",
        "prompt_tail_checkpoint",
        "mamba_output_checkpoint",
        "mamba_divergence_checkpoint",
        "async_load_liveness",
    ]
    options = " ".join(r["option"] for r in rows)
    for name in [*PluginConfig.model_fields, *ConnectorOptions.model_fields, "HybridSimpleCPUConnector", "NixlConnector"]:
        assert name in options


def test_each_patch_names_what_it_serves(adapter, capsys):
    from hybrid_kv_plugin.adapters.capabilities import PATCH_TAGS
    from hybrid_kv_plugin.patches import PATCH_MODULES, planned_patches

    assert {m.__name__.rsplit(".", 1)[1]: m.FEATURE for m in PATCH_MODULES if m.FEATURE == "vllm_fix"} == {
        "connector_hit_reconcile": "vllm_fix",
        "mamba_allocated_mark": "vllm_fix",
        "truncate_mamba_lookup": "vllm_fix",
        "finish_store_pinning": "vllm_fix",
        "same_step_copy_chains": "vllm_fix",
        "prompt_tail_keyed_once": "vllm_fix",
        "mamba_chunk_count_capped": "vllm_fix",
        "local_hit_admission": "vllm_fix",
        "step_stats_without_outputs": "vllm_fix",
        "stock_store_skips_handed_on_mamba": "vllm_fix",
        "mamba_split_keeps_block_grid": "vllm_fix",
    }
    assert all(m.FEATURE in PATCH_TAGS for m in PATCH_MODULES)
    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    # Grouped: each planned patch appears under its group's header, the fixes last.
    headers = [line for line in text.splitlines() if line.startswith("  ") and line.endswith("):")]
    assert headers[-1] == "  vLLM fix: standalone fixes of vLLM bugs (vllm_fix):"
    for planned in planned_patches(adapter):
        header = next(h for h in headers if h.endswith(f"({planned.feature}):"))
        assert text.index(header) < text.index(f"    {planned.spec.name} [")


def test_doctor_text_names_each_feature(adapter, capsys):
    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"hybrid-kv-plugin 0.1.0.dev0 on vLLM {adapter.version}\n")
    for title in (
        "Fine-grained hybrid prefix hits through CPU offload",
        "Mamba shared-prefix (junction) checkpoint under EAGLE",
        "NIXL P/D pairing of Mamba state slots",
    ):
        assert title in text


def test_doctor_reports_changed_target_and_fails(adapter, monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler

    from hybrid_kv_plugin.cli.doctor import run_doctor

    def changed(self, config, kv_cache_config, structured_output_manager, block_size, hash_block_size=None):
        raise AssertionError("never called")

    monkeypatch.setattr(Scheduler, "__init__", changed)
    out = io.StringIO()
    assert run_doctor(out=out) == 1
    assert "status:  mismatch (vllm.v1.core.sched.scheduler:Scheduler.__init__: signature is (self, config" in out.getvalue()


GOOD_SERVE = (
    "--enable-prefix-caching --block-size 16 --mamba-block-size 64 --prefix-match-unit 16 --mamba-cache-mode align "
    "--kv-transfer-config '{\"kv_connector\":\"HybridSimpleCPUConnector\",\"kv_role\":\"kv_both\","
    "\"kv_connector_extra_config\":{\"cpu_bytes_to_use\":1073741824}}'"
)


def test_doctor_validates_a_good_serve_line(adapter):
    from hybrid_kv_plugin.adapters import Feature
    from hybrid_kv_plugin.cli.serve_args import check_serve_args

    verdict = check_serve_args(GOOD_SERVE, adapter)
    assert verdict.errors == []
    fine = adapter.supports(Feature.FINE_GRAINED_CPU_HITS)
    assert verdict.reuse_granularity == (16 if fine else 64)
    assert verdict.min_cacheable_prefix == verdict.reuse_granularity
    assert len(verdict.notes) == (0 if fine else 1)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ("--kv-transfer-config '{bad'", "--kv-transfer-config: not valid JSON"),
        (
            "--kv-transfer-config '{\"kv_connector\":\"HybridSimpleCPUConnector\",\"kv_role\":\"both\"}'",
            "--kv-transfer-config.kv_role: 'both' (allowed: kv_producer, kv_consumer, kv_both)",
        ),
        (
            "--additional-config '{\"hybrid_kv\":{\"mamba_shared_prefix_checkpoint\":1}}'",
            "hybrid_kv.mamba_shared_prefix_checkpoint: Input should be a valid boolean",
        ),
        ("--mamba-cache-mode sometimes", "--mamba-cache-mode: 'sometimes' (allowed: none, align, all)"),
        ("--block-size 16 --mamba-block-size 64 --prefix-match-unit 24", "--prefix-match-unit: 24 must divide --block-size 16"),
        ("--speculative-config '[1]'", "--speculative-config: must be a JSON object"),
        (
            "--speculative-config '{\"method\":\"eagle\",\"num_speculative_tokens\":0}'",
            "--speculative-config.num_speculative_tokens: 0 (allowed: a positive integer)",
        ),
        ("--speculative-config '{\"method\":3}'", "--speculative-config.method: 3 is not a string"),
        ("--additional-config '{\"hybrid_kv\":{\"junction\":true}}'", "hybrid_kv.junction: unknown key"),
    ],
)
def test_doctor_rejects_invalid_serve_lines_with_exit_2(args, error, capsys):
    import shlex

    assert console_main(["doctor", "--", *shlex.split(args)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("hybrid-kv doctor: error: ")
    assert error in captured.err
    assert captured.err.count("\n") == 1


# ---------------------------------------------------------------------------- a real model's geometry
QWEN3_NEXT_DIR = "qwen3-next-80b-a3b-instruct"


def test_doctor_explains_a_unit_the_resolved_block_refuses(capsys):
    from hybrid_kv_plugin.sim.geometry import data_dir

    assert console_main(["doctor", "--", data_dir(QWEN3_NEXT_DIR), "--prefix-match-unit", "64"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    # One error, vLLM's, explained with the block vLLM resolved (no check against an assumed 16).
    assert captured.err.startswith("hybrid-kv doctor: error: vLLM refuses this geometry: Invalid prefix_match_unit=64; ")
    assert captured.err.endswith(
        "-- in plain words: --prefix-match-unit 64 must divide the 544-token attention block and the 544-token "
        "Mamba block vLLM resolves for Qwen3NextForCausalLM; units that do: 16, 32, 272, 544\n"
    )
    assert captured.err.count("\n") == 1
    assert "16" not in captured.err.split(" -- in plain words")[0].replace("prefix_match_unit=64", "")


def test_doctor_names_the_resolved_granularity_and_the_finer_unit(capsys):
    from hybrid_kv_plugin.sim.geometry import data_dir

    assert main(["doctor", "--", data_dir(QWEN3_NEXT_DIR), "--enable-prefix-caching"]) == 0
    out = capsys.readouterr().out
    assert "attention block 544 / Mamba block 544 align / prefix-match unit 544; max model len 262144" in out
    assert "  reuse granularity: 544 tokens; minimum cacheable prefix: 544 tokens\n" in out
    assert "  finer unit: --prefix-match-unit 16 (reuse every 16 tokens instead of 544)\n" in out
    assert "it costs 34 prefix hashes per 544-token block instead of 1, and each Mamba state kept at a unit " \
        "boundary is 38.2 MiB" in out
    assert main(["doctor", "--json", "--", data_dir(QWEN3_NEXT_DIR), "--enable-prefix-caching"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["unit_advice"] == {"unit": 16, "block": 544, "hashes_per_block": 34, "mamba_state_bytes": 36 * 1_114_112}
    assert report["serve_check"]["reuse_granularity"] == 544


def test_doctor_with_the_finer_unit_reuses_every_16_tokens(capsys):
    from hybrid_kv_plugin.sim.geometry import data_dir

    line = [data_dir(QWEN3_NEXT_DIR), "--enable-prefix-caching", "--prefix-match-unit", "16"]
    assert main(["doctor", "--json", "--", *line]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["serve_check"]["reuse_granularity"], report["unit_advice"]) == (16, None)
    assert report["serve_check"]["geometry"]["attention_block_size"] == 544


# ---------------------------------------------------------------------------- speculative decoding and the junction switch
BASE = "--enable-prefix-caching --block-size 16 --mamba-block-size 64 --prefix-match-unit 16 --mamba-cache-mode align"
EAGLE = "--speculative-config '{\"method\":\"eagle\",\"model\":\"draft\",\"num_speculative_tokens\":1}'"
SWITCH = "--additional-config '{\"hybrid_kv\":{\"mamba_shared_prefix_checkpoint\":true}}'"


def _junction(adapter, line: str) -> dict:
    from hybrid_kv_plugin.cli.serve_args import check_serve_args

    verdict = check_serve_args(line, adapter)
    assert verdict.errors == []
    return verdict.junction_checkpoint


def test_junction_takes_effect_with_eagle_and_the_switch(adapter):
    from hybrid_kv_plugin.adapters import Feature, Support

    native = adapter.verdict(Feature.MAMBA_SHARED_PREFIX_CHECKPOINT).support is Support.NATIVE
    how = "natively" if native else "through the plugin's backport"
    expected = {
        "switch": True,
        "effective": True,
        "reason": f"eagle drops the last matched block; the Mamba state at each shared-prefix junction "
        f"(one hash unit lower) is kept {how}, one extra state block per junction",
    }
    assert _junction(adapter, f"{BASE} {EAGLE} {SWITCH}") == expected
    # The wheels' own flag spelling switches it on too.
    assert _junction(adapter, f"{BASE} {EAGLE} --enable-mamba-shared-prefix-checkpoint") == expected


@pytest.mark.parametrize(
    ("line", "switch", "reason"),
    [
        (
            f"{BASE} {EAGLE}",
            False,
            "the switch is off; with eagle a sibling's hit stops one block short of the shared-prefix junction, "
            "where no Mamba state is kept: turn it on with --additional-config "
            "'{\"hybrid_kv\":{\"mamba_shared_prefix_checkpoint\":true}}' (or HYBRID_KV_MAMBA_SHARED_PREFIX_CHECKPOINT=1)",
        ),
        (
            f"{BASE} {SWITCH} --speculative-config '{{\"method\":\"eagle\",\"disable_eagle_block_drop\":true}}'",
            True,
            "disable_eagle_block_drop is set: the EAGLE block drop is off",
        ),
        (f"{BASE} {EAGLE} {SWITCH} --mamba-cache-mode all", True, "--mamba-cache-mode all: the junction state is only kept in align mode"),
        (
            f"{BASE} {EAGLE} {SWITCH} --block-size 64 --prefix-match-unit 64",
            True,
            "partial hash hits are disabled: --prefix-match-unit 64 is not finer than the Mamba block 64, "
            "so a junction inside a Mamba block is unreachable",
        ),
        (f"{BASE} {EAGLE} {SWITCH} --no-enable-prefix-caching", True, "prefix caching is off"),
    ],
)
def test_junction_says_why_it_would_not_take_effect(adapter, line, switch, reason):
    assert _junction(adapter, line) == {"switch": switch, "effective": False, "reason": reason}


@pytest.mark.parametrize(
    ("extra", "has", "reason"),
    [
        (
            "",
            "no speculative decoding",
            "no speculative decoding: without EAGLE's dropped block the block-floored junction already serves "
            "siblings, so the switch changes nothing",
        ),
        (
            "--speculative-config '{\"method\":\"ngram\",\"num_speculative_tokens\":3}'",
            "speculative method 'ngram'",
            "speculative method 'ngram' keeps every matched block (no EAGLE block drop)",
        ),
    ],
)
def test_switch_without_eagle_is_an_invalid_serve_line(adapter, extra, has, reason):
    """The engine would refuse to start (a conflict); the doctor says so and why the switch could not act."""
    from hybrid_kv_plugin.cli.serve_args import check_serve_args

    verdict = check_serve_args(f"{BASE} {SWITCH} {extra}", adapter)
    assert verdict.junction_checkpoint == {"switch": True, "effective": False, "reason": reason}
    assert verdict.errors == [
        "--additional-config: invalid hybrid-kv-plugin configuration: hybrid_kv.mamba_shared_prefix_checkpoint: true "
        f"needs EAGLE-style speculative decoding (--speculative-config method eagle, eagle3 or mtp) and this engine has "
        f"{has} (allowed without EAGLE: false)"
    ]


def test_no_junction_verdict_without_speculation_or_switch(adapter):
    assert _junction(adapter, BASE) is None


def test_doctor_prints_mode_and_junction_line(capsys):
    import shlex

    assert main(["doctor", "--", *shlex.split(f"--block-size 16 --mamba-block-size 64 --prefix-match-unit 16 {EAGLE}")]) == 0
    out = capsys.readouterr().out
    assert "  note: --mamba-cache-mode not set: vLLM picks align once prefix caching is on\n" in out
    assert "  note: prefix caching not given: vLLM turns it on only where the model supports it" in out
    assert "  mamba cache mode: align\n" in out
    assert "  junction checkpoint (switch off): no effect: the switch is off; with eagle" in out


def test_prefix_caching_off_has_no_granularity(adapter):
    from hybrid_kv_plugin.cli.serve_args import check_serve_args

    verdict = check_serve_args("--no-enable-prefix-caching --block-size 16", adapter)
    assert (verdict.errors, verdict.reuse_granularity, verdict.mamba_cache_mode) == ([], None, "none")
    assert verdict.notes == ["prefix caching is off (--no-enable-prefix-caching): no request reuses a prefix"]


@pytest.mark.parametrize(
    ("option", "fact"),
    [
        ('"prompt_tail_checkpoint": "both"', "prompt_tail_checkpoint_supported"),
        ('"mamba_output_checkpoint": true', "output_checkpoint_supported"),
        ('"mamba_divergence_checkpoint": true', "divergence_checkpoint_supported"),
    ],
)
def test_doctor_refuses_an_option_the_wheel_refuses_at_start_up(adapter, capsys, option, fact):
    """doctor says what start-up would say: the option's key and the first wheel that has it, exit 2."""
    from hybrid_kv_plugin.adapters import first_wheel_where

    argv = ["doctor", "--", "--enable-prefix-caching", "--additional-config", f'{{"hybrid_kv": {{{option}}}}}']
    code = console_main(argv)
    err_lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hybrid-kv")]
    key = option.split('"')[1]
    if getattr(adapter, fact):
        assert (code, err_lines) == (0, [])
    else:
        assert code == 2 and len(err_lines) == 1
        line = err_lines[0]
        assert line.startswith(f"hybrid-kv doctor: error: --additional-config: invalid hybrid-kv-plugin configuration: hybrid_kv.{key}")
        assert f"needs vLLM >= {first_wheel_where(fact)} and this is vLLM {adapter.version}" in line
