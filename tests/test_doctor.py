"""``hybrid-kv doctor`` prints the capability table of the installed wheel."""

from __future__ import annotations

import io
import json

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
