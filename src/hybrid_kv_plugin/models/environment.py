"""The process environment vLLM's config code runs in here: offline, with a private cache."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile


def offline_environment() -> None:
    """vLLM must not reach a hub, and its caches go to a private temp dir unless set.

    The dir is made only when needed (once per process) and removed when the process exits."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if "VLLM_CACHE_ROOT" not in os.environ:
        cache_root = tempfile.mkdtemp(prefix="hybrid-kv-vllm-cache-")
        atexit.register(shutil.rmtree, cache_root, True)
        os.environ["VLLM_CACHE_ROOT"] = cache_root
