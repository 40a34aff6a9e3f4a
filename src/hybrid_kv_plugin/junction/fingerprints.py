"""Fingerprints that also pin what the junction coordinator backport relies on inside vLLM code.

The base :class:`~hybrid_kv_plugin.patching.Fingerprint` checks signatures and
class attributes. The junction backport also depends on *instance* attributes
(which a class does not show) and on what the stock Mamba manager touches. Both
are visible in the bytecode: which names an ``__init__`` stores, which
``self.<name>`` a method loads (:func:`hybrid_kv_plugin.patching.self_attribute_reads`).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

from hybrid_kv_plugin.patching import Fingerprint, self_attribute_reads


def _param_names(function: Any) -> tuple[str, ...]:
    return tuple(inspect.signature(function).parameters)


@dataclass(frozen=True)
class MambaManagerShape:
    """What the junction Mamba manager subclass overrides or touches on the wheel's ``MambaManager``."""

    module: str
    partial_tail_reads: frozenset[str]

    def check(self) -> str | None:
        stock = getattr(importlib.import_module(self.module), "MambaManager", None)
        if stock is None:
            return "MambaManager not found"
        expected = {
            "_cache_partial_tail_block": ("self", "request", "num_tokens"),
            "cache_blocks": ("self", "request", "num_tokens", "retention_interval"),
        }
        for method, params in expected.items():
            function = getattr(stock, method, None)
            if function is None or _param_names(function) != params:
                return f"MambaManager.{method} is not ({', '.join(params)})"
        mask = getattr(stock, "reachable_block_mask", None)
        if mask is None or "reachable_boundaries" not in _param_names(mask):
            return "MambaManager.reachable_block_mask takes no reachable_boundaries"
        found = self_attribute_reads(stock._cache_partial_tail_block)
        if found != self.partial_tail_reads:
            return f"MambaManager._cache_partial_tail_block touches {', '.join(sorted(found))}"
        return None


@dataclass(frozen=True)
class CoordinatorFingerprint(Fingerprint):
    """``Fingerprint`` of the hybrid coordinator class, its stored attributes, and its Mamba manager."""

    stored_attrs: tuple[str, ...] = ()
    manager: MambaManagerShape | None = None

    def check(self, original: Any, owner: Any) -> str | None:
        if reason := super().check(original, owner):
            return reason
        stored: set[str] = set()
        for cls in inspect.getmro(original):
            init = vars(cls).get("__init__")
            if init is not None and hasattr(init, "__code__"):
                stored.update(init.__code__.co_names)
        if missing := [name for name in self.stored_attrs if name not in stored]:
            return f"the coordinator no longer sets {', '.join(missing)}"
        return self.manager.check() if self.manager is not None else None
