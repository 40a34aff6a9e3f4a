"""``hybrid-kv doctor`` prints the capability table of the installed wheel."""

from __future__ import annotations

import io
import json

import pytest

from hybrid_kv_plugin.cli.main import main

from test_adapters import CAPABILITY_TABLE


def test_doctor_table_matches_adapter(adapter, capsys, monkeypatch):
    monkeypatch.delenv("HYBRID_KV_PLUGIN_DISABLE", raising=False)
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["vllm_version"] == adapter.version
    assert report["adapter"] == adapter.name
    assert report["status"] == "active"
    supports = tuple(f["support"] for f in report["features"])
    assert supports == tuple(s.value for s in CAPABILITY_TABLE[adapter.version])
    assert [p["name"] for p in report["patches"]] == [s.name for s in adapter.patch_specs()]


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
    ],
)
def test_doctor_rejects_invalid_serve_lines_with_exit_2(args, error, capsys):
    import shlex

    assert main(["doctor", "--", *shlex.split(args)]) == 2
    out = capsys.readouterr().out
    assert "vllm serve arguments: INVALID" in out
    assert error in out
