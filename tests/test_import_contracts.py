"""The layering of ARCHITECTURE.md holds, checked by ``lint-imports`` (import-linter) on the package.

The contracts live in ``pyproject.toml`` (``[tool.importlinter]``): the layers, the five feature
folders independent of each other, no import circle among the modules of any one folder (imports
inside functions count), and no import of test-only code. A contract that cannot fail
proves nothing, so each one is also broken on purpose in a scratch copy of the package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
CONTRACTS = (
    "a module imports only from layers below its own KEPT",
    "the feature folders do not import each other KEPT",
    "no import circle among the modules of any one folder KEPT",
    "the package never imports test-only code KEPT",
)


def lint_imports(tree: Path, *args: str) -> subprocess.CompletedProcess:
    """``lint-imports`` on ``tree/src/hybrid_kv_plugin`` with ``tree/pyproject.toml``; no cache left behind."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"), COLUMNS="300", NO_COLOR="1")
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo", "--config", str(tree / "pyproject.toml"), *args],
        cwd=tree, env=env, capture_output=True, text=True, timeout=300,
    )


def test_the_package_keeps_every_contract():
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for line in CONTRACTS:
        assert line in done.stdout
    assert "Contracts: 4 kept, 0 broken." in done.stdout


@pytest.mark.parametrize(
    ("contract", "module", "line", "reported"),
    [
        # adapters/ sit below everything but the machinery: an import of cli/ from there runs up.
        ("layers", "adapters/capabilities.py", "from hybrid_kv_plugin.cli import main",
         "hybrid_kv_plugin.adapters.capabilities -> hybrid_kv_plugin.cli.main"),
        ("features", "nixl/pairing.py", "from hybrid_kv_plugin.junction import gate",
         "hybrid_kv_plugin.nixl.pairing -> hybrid_kv_plugin.junction.gate"),
        # engine.py builds the byte cache: the byte cache asking the engine back closes a circle.
        ("acyclic", "sim/byte_cache.py", "from hybrid_kv_plugin.sim import engine",
         "No cycles are allowed in hybrid_kv_plugin.sim."),
        ("no-tests", "registration.py", "import scenarios.offload",
         "hybrid_kv_plugin.registration -> scenarios"),
    ],
)
def test_a_deliberate_bad_import_breaks_its_contract(contract, module, line, reported):
    scratch = Path(tempfile.mkdtemp(prefix="hybrid-kv-lint-"))
    try:
        shutil.copytree(ROOT / "src" / "hybrid_kv_plugin", scratch / "src" / "hybrid_kv_plugin",
                        ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(ROOT / "pyproject.toml", scratch / "pyproject.toml")
        target = scratch / "src" / "hybrid_kv_plugin" / module
        target.write_text(target.read_text() + f"\n{line}  # deliberate\n")
        done = lint_imports(scratch, "--contract", contract)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert not scratch.exists()
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Contracts: 0 kept, 1 broken." in done.stdout
    assert reported in done.stdout
