"""Shared fixtures: the installed stock vLLM wheel, driven for real on a CPU.

One pytest process per wheel (``scripts/test``): vLLM's imports and the first
``ModelConfig`` are slow, every later scheduler builds in milliseconds.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import shutil
import signal
import tempfile

import pytest

# Nothing left behind: every temp dir this session and its subprocesses make goes under one
# private root (TMPDIR), checked and removed at the end (pytest_sessionfinish). A private
# root, because other processes on the machine create hybrid-kv-* entries in /tmp too.
SESSION_TMP = tempfile.mkdtemp(prefix="hybrid-kv-pytest-")
os.environ["TMPDIR"] = SESSION_TMP
tempfile.tempdir = SESSION_TMP
# tests/engine/ drives a real engine and needs its own environment (`scripts/test
# cpu-0.32.0`, which installs the test-only copy stand-in): nowhere else is it collected.
if importlib.util.find_spec("hybrid_kv_test_copy_standin") is None:
    collect_ignore = ["engine"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "VLLM_CACHE_ROOT" not in os.environ:
    os.environ["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="hybrid-kv-test-cache-")
_EXPECTED_TMP = {os.path.basename(os.environ["VLLM_CACHE_ROOT"])}

import hybrid_kv_plugin  # noqa: E402
from hybrid_kv_plugin import registration  # noqa: E402
from hybrid_kv_plugin.adapters import select_adapter  # noqa: E402
from hybrid_kv_plugin.sim import HybridGeometry, SimEngine  # noqa: E402
from hybrid_kv_plugin.sim.engine import default_scheduling  # noqa: E402

from helpers import recording  # noqa: E402

def leftover_temp_entries() -> list[str]:
    """The plugin's own temp entries (``hybrid-kv-*``) the session made and did not remove."""
    return sorted(e for e in os.listdir(SESSION_TMP) if e.startswith("hybrid-kv-") and e not in _EXPECTED_TMP)


# pytest can stop before any session (a usage error): the private root still goes at exit.
atexit.register(shutil.rmtree, SESSION_TMP, ignore_errors=True)
_SESSION_PID = os.getpid()


def _interrupt_on_sigterm(signum, frame):
    """A stopped run (CI's timeout, a `kill`) ends like Ctrl-C: fixtures torn down, the root removed.

    Without it SIGTERM kills the process outright and neither atexit nor sessionfinish runs. A
    process forked from this one (a probe, an engine core) gets the default action instead.
    """
    if os.getpid() != _SESSION_PID:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise KeyboardInterrupt(f"signal {signum}")


if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
    signal.signal(signal.SIGTERM, _interrupt_on_sigterm)


def pytest_sessionfinish(session, exitstatus):
    leftovers = leftover_temp_entries()
    shutil.rmtree(SESSION_TMP, ignore_errors=True)
    if leftovers:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"temp entries left behind by the tests or the commands they ran: {', '.join(leftovers)}"
        if reporter is not None:
            reporter.write_line(f"FAILED nothing-left-behind check: {message}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "both_schedulers: run the test under Scheduler and AsyncScheduler (engines it builds, parameter sync/async)"
    )


def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("both_schedulers") is not None:
        metafunc.parametrize("scheduling", ["sync", "async"], indirect=True)


@pytest.fixture(autouse=True)
def scheduling(request):
    """The engine core every SimEngine of the test plays: "sync" (EngineCore.step) unless marked both_schedulers."""
    mode = getattr(request, "param", "sync")
    with default_scheduling(mode == "async"):
        yield mode


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


@pytest.fixture
def plugin_log():
    """Every record of the plugin's own logger (a child of vLLM's), whatever vLLM's propagation."""
    with recording("vllm.hybrid_kv_plugin", logging.DEBUG) as handler:
        yield handler
