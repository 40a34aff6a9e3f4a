"""Every adapter family of the plugin, found by module name: a new wheel family is one new module.

A module ``vllm_<major>_<minor>.py`` in this package defines one :class:`VllmAdapter`
subclass with its ``families``, ``tested_wheels`` and ``probe()``. ``ADAPTERS`` lists them
oldest first; the supported range (:mod:`.detect`), doctor, the patch manifest and the
start-up refusals read it, and ``scripts/pins/vllm-<wheel>.txt`` makes the test
environment of each tested wheel (``tests/test_supported_versions.py`` keeps the two equal).
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

from hybrid_kv_plugin.adapters.base import VllmAdapter

_FAMILY_MODULE = re.compile(r"vllm_\d+_\d+")


def _family_classes() -> tuple[type[VllmAdapter], ...]:
    found: list[type[VllmAdapter]] = []
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if not _FAMILY_MODULE.fullmatch(info.name):
            continue
        module = importlib.import_module(f"{__package__}.{info.name}")
        found += [
            value
            for value in vars(module).values()
            if isinstance(value, type) and issubclass(value, VllmAdapter)
            and value.__module__ == module.__name__ and value.families
        ]
    return tuple(sorted(found, key=lambda cls: cls.families[0]))


ADAPTERS: tuple[type[VllmAdapter], ...] = _family_classes()


def supported_range(adapters: tuple[type[VllmAdapter], ...] = ADAPTERS) -> str:
    """``">=0.26.0,<0.34.0"``: from the oldest family to the one after the newest."""
    first = adapters[0].families[0]
    last = adapters[-1].families[-1]
    return f">={first[0]}.{first[1]}.0,<{last[0]}.{last[1] + 1}.0"


def first_wheel_where(fact: str, adapters: tuple[type[VllmAdapter], ...] = ADAPTERS) -> str:
    """The first tested wheel whose adapter has ``fact`` true (named by a start-up refusal)."""
    return next(cls.tested_wheels[0] for cls in adapters if getattr(cls, fact))
