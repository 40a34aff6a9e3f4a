"""vLLM's model inspection, run in this process and without torchvision.

To learn whether an architecture is hybrid, vLLM imports the model's module in a fresh
subprocess. Some hybrid models' modules (Qwen3.5, Qwen3.5-MoE: their vision-language
siblings' code) import transformers' image processors, which import ``torchvision`` at module
level; the lean environments this project runs in have none (PyPI's torchvision does not
load beside the CPU torch), so the inspection fails although the text model never touches an
image. Only the KV-cache facts of the class are read here (``is_hybrid``, the Mamba state
shapes and dtypes), never an image path.

:func:`model_inspection` therefore, for the duration of one geometry resolution or one
simulated engine's config (sim/geometry.py) only:

- runs the inspection in this process (the subprocess exists to keep CUDA uninitialised
  in a server that forks workers; ``doctor``, ``replay`` and the simulated engines fork
  nothing; the subprocess imported vLLM again, 23 s per engine on 2 cores), and
- where ``torchvision`` cannot be imported, answers ``import torchvision...`` with
  placeholder modules whose attributes raise ``ImportError`` when used.

Both are undone on exit. Nothing here runs inside a vLLM server: ``register()`` never
imports this module, and vLLM's own code is left as it is.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

_ABSENT = "torchvision"


class _Absent:
    """Stands for a torchvision object at import time; using it raises ImportError."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Absent:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Absent(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ImportError(f"{self._name}: torchvision is not installed (geometry resolution only)")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


class _AbsentLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []  # a package, so ``torchvision.transforms.v2`` imports too

        def __getattr__(attr: str) -> _Absent:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _Absent(f"{spec.name}.{attr}")

        module.__getattr__ = __getattr__  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _AbsentFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == _ABSENT or name.startswith(_ABSENT + "."):
            return importlib.machinery.ModuleSpec(name, _AbsentLoader(), is_package=True)
        return None


@contextmanager
def _placeholder_torchvision() -> Iterator[None]:
    """Placeholder ``torchvision`` modules while inside, where the real one is absent.

    Entered only after transformers has decided torchvision is unavailable (it has, once
    ``vllm.config`` is imported), so transformers keeps its torchvision-free code paths."""
    if importlib.util.find_spec(_ABSENT) is not None:
        yield
        return
    finder = _AbsentFinder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n == _ABSENT or n.startswith(_ABSENT + ".")]:
            del sys.modules[name]


def _in_process(fn: Callable[[], Any]) -> Any:
    return fn()


@contextmanager
def model_inspection() -> Iterator[None]:
    """vLLM's model inspection in this process, torchvision optional (see the module docstring)."""
    import vllm.config  # noqa: F401 - transformers settles torchvision's availability first
    from vllm.model_executor.models import registry

    original = registry._run_in_subprocess
    registry._run_in_subprocess = _in_process
    try:
        with _placeholder_torchvision():
            yield
    finally:
        registry._run_in_subprocess = original
