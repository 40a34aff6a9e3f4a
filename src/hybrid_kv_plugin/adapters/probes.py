"""What a family's ``probe()`` reads from an installed vLLM whose version string carries no release number.

Each helper answers False (or an empty set) when the module does not import: a build
without the module is not the family that has it.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect


def has(module: str, attribute: str) -> bool:
    """``module`` imports and has ``attribute`` (a dotted path: ``"Class.method"``)."""
    try:
        owner = importlib.import_module(module)
    except Exception:
        return False
    for part in attribute.split("."):
        if not hasattr(owner, part):
            return False
        owner = getattr(owner, part)
    return True


def cache_config_fields() -> frozenset[str]:
    try:
        from vllm.config import CacheConfig
    except Exception:
        return frozenset()
    return frozenset(field.name for field in dataclasses.fields(CacheConfig))


def parameters(module: str, function: str) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(getattr(importlib.import_module(module), function)).parameters)
    except Exception:
        return frozenset()
