"""The process environment vLLM's config code runs in here: offline, with private temp dirs."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

# What a command's private temp root replaces while it runs (restored after, for in-process callers).
_TEMP_VARIABLES = ("TMPDIR", "VLLM_CACHE_ROOT")


def offline_environment() -> None:
    """vLLM must not reach a hub, and its caches go to a private temp dir unless set.

    The dir is made only when needed (once per process) and removed when the process exits."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if "VLLM_CACHE_ROOT" not in os.environ:
        cache_root = tempfile.mkdtemp(prefix="hybrid-kv-vllm-cache-")
        atexit.register(shutil.rmtree, cache_root, True)
        os.environ["VLLM_CACHE_ROOT"] = cache_root


@contextlib.contextmanager
def private_temp_root() -> Iterator[str]:
    """One ``hybrid-kv`` command's temp root: ``TMPDIR`` (so also torch's compile cache and vLLM's
    model-inspection files) and, unless set, ``VLLM_CACHE_ROOT`` point into it, for this process
    and every child it starts, and it is removed on the way out.

    Child processes (``replay --jobs``) inherit it instead of making temp dirs of their own,
    which they could not remove: a pool worker never runs ``atexit``, and a terminated one
    runs nothing. The caller's environment is restored afterwards."""
    root = tempfile.mkdtemp(prefix="hybrid-kv-run-")
    saved = {name: os.environ.get(name) for name in _TEMP_VARIABLES}
    saved_tempdir = tempfile.tempdir
    os.environ["TMPDIR"] = root
    tempfile.tempdir = root
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(root, "vllm-cache"))
    try:
        yield root
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        tempfile.tempdir = saved_tempdir
        shutil.rmtree(root, ignore_errors=True)
