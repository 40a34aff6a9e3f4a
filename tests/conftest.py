"""Shared fixtures: the installed stock vLLM wheel, driven for real on a CPU.

One pytest process per wheel (``scripts/test``): vLLM's imports and the first
``ModelConfig`` are slow, every later scheduler builds in milliseconds.
"""

from __future__ import annotations

import logging
import os
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "VLLM_CACHE_ROOT" not in os.environ:
    # Made only when unset (setdefault would make one per run regardless) and removed at exit.
    import atexit
    import shutil

    os.environ["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="hybrid-kv-test-cache-")
    atexit.register(shutil.rmtree, os.environ["VLLM_CACHE_ROOT"], ignore_errors=True)

import hybrid_kv_plugin  # noqa: E402
from hybrid_kv_plugin import registration  # noqa: E402
from hybrid_kv_plugin.adapters import select_adapter  # noqa: E402
from hybrid_kv_plugin.sim import HybridGeometry, SimEngine  # noqa: E402

@pytest.fixture(scope="session")
def adapter():
    selection = select_adapter()
    assert selection.adapter is not None, selection.reason
    return selection.adapter


@pytest.fixture(scope="session")
def wheel_version(adapter) -> str:
    return adapter.version


@pytest.fixture
def plugin():
    """The plugin registered for the test, and fully uninstalled afterwards."""
    hybrid_kv_plugin.uninstall()
    hybrid_kv_plugin.register()
    assert registration.STATE.status == "active", registration.STATE.reason
    yield registration.STATE
    hybrid_kv_plugin.uninstall()


@pytest.fixture
def no_plugin():
    """Stock vLLM: the plugin is uninstalled before and after the test."""
    hybrid_kv_plugin.uninstall()
    yield
    hybrid_kv_plugin.uninstall()


@pytest.fixture
def make_engine(adapter):
    def factory(geometry: HybridGeometry | None = None, **kwargs) -> SimEngine:
        return SimEngine(geometry or HybridGeometry(), adapter=adapter, **kwargs)

    return factory


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, level: int = logging.DEBUG) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= level]


@pytest.fixture
def plugin_log():
    """Every record of the plugin's own logger (a child of vLLM's), whatever vLLM's propagation."""
    logger = logging.getLogger("vllm.hybrid_kv_plugin")
    handler = _Records()
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old_level)
