"""The optional dependencies, computed: the ``vllm`` extra spans the adapter families.

A family is a module ``src/hybrid_kv_plugin/adapters/vllm_<major>_<minor>.py``; adding one
widens the extra with no edit here. Everything else is declared in pyproject.toml.
"""

import re
from pathlib import Path

from setuptools import setup

ADAPTERS = Path(__file__).resolve().parent / "src" / "hybrid_kv_plugin" / "adapters"


def vllm_requirement() -> str:
    """``vllm>=0.26,<0.34`` for families 0.26 ... 0.33."""
    names = (re.fullmatch(r"vllm_(\d+)_(\d+)\.py", path.name) for path in ADAPTERS.iterdir())
    families = sorted((int(m[1]), int(m[2])) for m in names if m)
    first, last = families[0], families[-1]
    return f"vllm>={first[0]}.{first[1]},<{last[0]}.{last[1] + 1}"


setup(
    extras_require={
        # a fresh environment only: pulls a stock vLLM of the supported range (and its torch)
        "vllm": [vllm_requirement()],
        "nixl": ["nixl==1.5.1", "nixl-cu12==1.5.1"],
        "test": ["pytest", "pytest-mock", "hypothesis", "import-linter"],
        "plot": ["matplotlib"],
        # HybridMooncakeStoreConnector's store client (needs the system library libibverbs.so.1)
        "mooncake": ["mooncake-transfer-engine-non-cuda==0.3.13.post1"],
    }
)
