"""The built distribution, as a vLLM operator installs it: no vLLM requirement, the license and
metadata, the sdist's examples/ and scripts/, and a wheel that vLLM finds once installed with
``--no-deps`` into an environment that already has a stock vLLM."""

from __future__ import annotations

import os
import pathlib
import shutil
import site
import subprocess
import sys
import tarfile
import tempfile
import zipfile

import pytest

import hybrid_kv_plugin
from hybrid_kv_plugin.adapters import ADAPTERS

ROOT = pathlib.Path(__file__).parents[1]
VERSION = hybrid_kv_plugin.__version__
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "LICENSE", "README.md", "CHANGELOG.md", "CONTRIBUTING.md",
           "src", "examples", "scripts", ".ci")


def _clean_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the installed wheel, not this checkout, must answer
    return env


@pytest.fixture(scope="module")
def built():
    """sdist + wheel built offline by the setuptools of this test's environment, from a copy of
    the checkout (the build writes build/ and *.egg-info); the temp dir goes at the end."""
    work = tempfile.mkdtemp(prefix="hybrid-kv-build-")
    try:
        tree = pathlib.Path(work, "tree")
        for name in SOURCES:
            source = ROOT / name
            if source.is_dir():
                shutil.copytree(source, tree / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc"))
            else:
                tree.mkdir(exist_ok=True)
                shutil.copy2(source, tree / name)
        dist = pathlib.Path(work, "dist")
        script = (
            "import sys; from setuptools import build_meta as b; "
            "out = sys.argv[1]; b.build_sdist(out); b.build_wheel(out)"  # build_meta rewrites sys.argv
        )
        done = subprocess.run([sys.executable, "-c", script, str(dist)], cwd=tree,
                              capture_output=True, text=True, env=_clean_env(), timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        (sdist,) = dist.glob("*.tar.gz")
        (wheel,) = dist.glob("*.whl")
        yield work, sdist, wheel
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert not os.path.exists(work)


def _metadata(wheel: pathlib.Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(f"hybrid_kv_plugin-{VERSION}.dist-info/METADATA").decode().splitlines()


def test_wheel_never_requires_vllm_and_states_its_license(built):
    _, _, wheel = built
    metadata = _metadata(wheel)
    requires = [line.removeprefix("Requires-Dist: ") for line in metadata if line.startswith("Requires-Dist: ")]
    unconditional = [r for r in requires if "extra ==" not in r]
    assert unconditional == ["pydantic>=2"]
    # setup.py reads the adapter modules' names; the range is the adapters' own families
    first, last = ADAPTERS[0].families[0], ADAPTERS[-1].families[-1]
    assert f'vllm<{last[0]}.{last[1] + 1},>={first[0]}.{first[1]}; extra == "vllm"' in requires
    assert 'nixl==1.5.1; extra == "nixl"' in requires and 'import-linter; extra == "test"' in requires
    assert "License-Expression: Apache-2.0" in metadata
    assert "License-File: LICENSE" in metadata
    assert any(line.startswith("Classifier: Programming Language :: Python :: 3.11") for line in metadata)
    assert sum(line.startswith("Project-URL: ") for line in metadata) == 4
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = archive.read(f"hybrid_kv_plugin-{VERSION}.dist-info/entry_points.txt").decode()
    assert f"hybrid_kv_plugin-{VERSION}.dist-info/licenses/LICENSE" in names
    assert "hybrid_kv_plugin/sim/data/tiny-qwen3-next/config.json" in names
    assert "[vllm.general_plugins]\nhybrid_kv = hybrid_kv_plugin:register" in entry_points
    assert "[console_scripts]\nhybrid-kv = hybrid_kv_plugin.cli.main:console_main" in entry_points


# The moved test scaffolding (tests/scenarios/, tests/soak/): never back in the wheel.
TEST_ONLY = ("offload_scenarios", "prompt_tail_scenarios", "output_checkpoint_scenarios", "nixl_pair", "soak",
             "fault_invariants", "step_invariants", "scenarios", "conftest", "helpers")


def _runtime_modules() -> set[str]:
    """Modules of the package that vLLM or ``hybrid-kv`` can load: the entry points (the plugin, the
    console script, the connector's class path, the adapter families that ``adapters/families.py``
    imports by name) and everything they import, with its parent packages."""
    import grimp

    from hybrid_kv_plugin.connector_names import CONNECTOR_MODULE, STORE_CONNECTOR_MODULE

    graph = grimp.build_graph("hybrid_kv_plugin", cache_dir=None)
    todo = ["hybrid_kv_plugin", "hybrid_kv_plugin.cli.main", CONNECTOR_MODULE, STORE_CONNECTOR_MODULE,
            *(cls.__module__ for cls in ADAPTERS)]
    reached: set[str] = set()
    while todo:
        module = todo.pop()
        if module and module not in reached:
            reached.add(module)
            todo += [*graph.find_modules_directly_imported_by(module), module.rpartition(".")[0]]
    return reached


def test_wheel_holds_no_module_that_only_tests_import(built):
    _, _, wheel = built
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    modules = {name.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
               for name in names if name.endswith(".py")}
    assert "hybrid_kv_plugin.sim.replay" in modules and "hybrid_kv_plugin.sim.invariants" in modules
    assert not {m for m in modules if set(m.split(".")) & set(TEST_ONLY)}
    assert all(m.startswith("hybrid_kv_plugin.") or m == "hybrid_kv_plugin" for m in modules), sorted(modules)
    # Nothing else either: a module no entry point reaches is one only tests import.
    assert modules - _runtime_modules() == set()


def test_sdist_carries_examples_scripts_and_license(built):
    _, sdist, _ = built
    prefix = f"hybrid_kv_plugin-{VERSION}/"
    with tarfile.open(sdist) as archive:
        names = {name.removeprefix(prefix) for name in archive.getnames()}
    expected = {"LICENSE", "README.md", "CHANGELOG.md", "CONTRIBUTING.md", "examples/multi_turn_cpu_offload.py", "examples/gpu_e2e.py",
                "scripts/demo", "scripts/test", "scripts/versions", "scripts/pins/vllm-0.29.0.txt", ".ci/run", "setup.py",
                "src/hybrid_kv_plugin/ARCHITECTURE.md"}
    assert expected <= names, sorted(expected - names)


def test_wheel_installed_no_deps_next_to_stock_vllm_is_found_by_vllm(built, adapter):
    """A throwaway venv that sees this test's stock vLLM (a .pth line), the wheel installed with
    ``uv pip install --no-deps``: vLLM's plugin group names it, and the console script runs."""
    work, _, wheel = built
    uv = shutil.which("uv")
    assert uv is not None, "uv is required (scripts/test installs it; python3 -m pip install uv)"
    venv = pathlib.Path(work, "venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # plain path lines: the stock packages become importable, their .pth files (this checkout's
    # editable install) are not run
    pathlib.Path(purelib, "stock-vllm.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    done = subprocess.run([uv, "pip", "install", "--offline", "--no-deps", "-p", str(python), str(wheel)],
                          capture_output=True, text=True, env=_clean_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    probe = (
        "import importlib.metadata as m, hybrid_kv_plugin; "
        "eps = [e for e in m.entry_points(group='vllm.general_plugins') if e.name == 'hybrid_kv']; "
        "print(len(eps), eps[0].value, eps[0].dist.version, hybrid_kv_plugin.__file__)"
    )
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, env=_clean_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    count, value, version, location = done.stdout.split()
    assert (count, value, version) == ("1", "hybrid_kv_plugin:register", VERSION)
    assert location.startswith(purelib)
    done = subprocess.run([venv / "bin" / "hybrid-kv", "--version"], capture_output=True, text=True,
                          env=_clean_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == f"hybrid-kv-plugin {VERSION} on vLLM {adapter.version} ({adapter.name})\n"
