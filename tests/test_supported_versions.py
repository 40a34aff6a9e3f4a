"""The supported vLLM versions come from one place: the adapter modules and the pins files.

``src/hybrid_kv_plugin/adapters/vllm_<major>_<minor>.py`` (found by ``adapters/families.py``)
gives the families, the supported range, doctor's range text, the patch manifest's
"present up to" note and the ``vllm`` extra (``setup.py``); ``scripts/pins/vllm-<wheel>.txt``
gives the wheels ``scripts/test`` and ``.ci/run`` test (``scripts/versions``). A fake 0.34
family added to a scratch copy - one adapter module and one pins file - moves all of them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from hybrid_kv_plugin.adapters import ADAPTERS
from hybrid_kv_plugin.adapters.detect import SUPPORTED_RANGE

ROOT = Path(__file__).resolve().parents[1]
STOCK = "0.26.0 0.27.1 0.28.0 0.29.0 0.30.0 0.31.0 0.32.0 0.33.0"
# The engine builds .ci/run tests (CI_ENGINES in scripts/versions; a new stock family adds none).
ENGINES = "cpu-0.32.0 cpu-0.29.0"

FAKE_FAMILY = '''"""A fake vLLM 0.34.x family (tests/test_supported_versions.py)."""

from hybrid_kv_plugin.adapters.vllm_0_33 import Vllm033Adapter


class Vllm034Adapter(Vllm033Adapter):
    families = ((0, 34),)
    tested_wheels = ("0.34.0",)

    @classmethod
    def probe(cls) -> bool:
        return False
'''

# What every reader of the version list says, asked in a child interpreter on ``tree``.
REPORT = r'''
import json, runpy, sys
import setuptools
extras = {}
setuptools.setup = lambda **kwargs: extras.update(kwargs["extras_require"])
runpy.run_path(sys.argv[1] + "/setup.py")

import hybrid_kv_plugin.adapters as adapters
from hybrid_kv_plugin.adapters import ADAPTERS, select_adapter
from hybrid_kv_plugin.adapters.detect import SUPPORTED_RANGE, InstalledVllm
from hybrid_kv_plugin.cli.doctor import collect
from hybrid_kv_plugin.patching import Installs
from hybrid_kv_plugin.patches import removal_note

newest = ADAPTERS[-1].families[-1]
beyond = f"{newest[0]}.{newest[1] + 1}.0"
adapters.installed_vllm = lambda: InstalledVllm(beyond, (newest[0], newest[1] + 1, 0))
print(json.dumps({
    "range": SUPPORTED_RANGE,
    "families": [list(f) for cls in ADAPTERS for f in cls.families],
    "selected": select_adapter(InstalledVllm("0.34.0", (0, 34, 0))).reason,
    "doctor": collect().reason,
    "removal": removal_note(Installs(when=lambda adapter: True, since="0.29.0")),
    "extra": extras["vllm"],
}))
'''


def _sh(script: str, cwd: Path) -> str:
    return subprocess.run(["bash", "-c", script], cwd=cwd, capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip()


def versions(tree: Path) -> dict[str, object]:
    """The lists as scripts/test and .ci/run compute them (their own assignment lines), and the package's."""
    test_line = re.search(r"^DEFAULT_VERSIONS=.*$", (tree / "scripts" / "test").read_text(), re.M).group(0)
    ci_line = re.search(r"^VLLM_VERSIONS=.*$", (tree / ".ci" / "run").read_text(), re.M).group(0)
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    done = subprocess.run([sys.executable, "-c", REPORT, str(tree)], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return {
        "scripts/test": _sh(f'ROOT="$PWD"; {test_line}; echo "$DEFAULT_VERSIONS"', tree),
        ".ci/run": _sh(f'{ci_line}; echo "$VLLM_VERSIONS"', tree),
        **json.loads(done.stdout.strip().splitlines()[-1]),
    }


def test_the_adapters_and_the_pins_files_name_the_same_wheels():
    assert _sh("scripts/versions stock", ROOT) == STOCK
    assert [w for cls in ADAPTERS for w in cls.tested_wheels] == STOCK.split()
    assert SUPPORTED_RANGE == ">=0.26.0,<0.34.0"
    for older, newer in zip(ADAPTERS, ADAPTERS[1:]):
        assert newer.__bases__ == (older,), newer  # each family overrides only what changed
    for cls in ADAPTERS:
        # the module is named for its family, and the family can be probed without a version number
        assert cls.__module__ == "hybrid_kv_plugin.adapters.vllm_{}_{}".format(*cls.families[0])
        assert "probe" in vars(cls), cls


def test_a_new_family_is_one_adapter_module_and_one_pins_file():
    scratch = Path(tempfile.mkdtemp(prefix="hybrid-kv-versions-"))
    try:
        for name in ("src", "scripts", ".ci"):
            shutil.copytree(ROOT / name, scratch / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        shutil.copy2(ROOT / "setup.py", scratch / "setup.py")
        before = versions(scratch)
        (scratch / "src" / "hybrid_kv_plugin" / "adapters" / "vllm_0_34.py").write_text(FAKE_FAMILY)
        shutil.copy2(ROOT / "scripts" / "pins" / "vllm-0.33.0.txt", scratch / "scripts" / "pins" / "vllm-0.34.0.txt")
        after = versions(scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert not scratch.exists()
    assert before == {
        "scripts/test": STOCK,
        ".ci/run": f"{ENGINES} {STOCK}",
        "range": ">=0.26.0,<0.34.0",
        "families": [[0, minor] for minor in range(26, 34)],
        "selected": "vLLM 0.34.0 is outside the supported range >=0.26.0,<0.34.0",
        "doctor": "vLLM 0.34.0 is outside the supported range >=0.26.0,<0.34.0",
        "removal": "not yet (present up to 0.33.0)",
        "extra": ["vllm>=0.26,<0.34"],
    }
    assert after == {
        "scripts/test": f"{STOCK} 0.34.0",
        ".ci/run": f"{ENGINES} {STOCK} 0.34.0",
        "range": ">=0.26.0,<0.35.0",
        "families": [[0, minor] for minor in range(26, 35)],
        "selected": "vLLM 0.34.0 via package metadata",
        "doctor": "vLLM 0.35.0 is outside the supported range >=0.26.0,<0.35.0",
        "removal": "not yet (present up to 0.34.0)",
        "extra": ["vllm>=0.26,<0.35"],
    }
