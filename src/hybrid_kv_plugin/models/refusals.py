"""vLLM's refusals of a model geometry, in plain words.

vLLM's message is kept wherever it names what to change; where it does not (a bare
``AssertionError``, a ``TypeError`` from a missing config field, an architecture it no longer
serves), :func:`explain` names the config field or serve flag, its value, and what would work.
Each rule matches one known refusal exactly; anything else is vLLM's own line.
"""

from __future__ import annotations

import json
import os
from typing import Any

PREFIX = "vLLM refuses this geometry: "


def _config(model: str) -> dict[str, Any]:
    try:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def explain(serve: Any, exc: BaseException, message: str) -> str:
    """One line for ``exc``, raised by vLLM while resolving ``serve``'s geometry."""
    config = _config(serve.model or "")
    for rule in _RULES:
        line = rule(serve, config, exc, message)
        if line:
            return PREFIX + line
    return PREFIX + message


def removed_architecture(model: str) -> str | None:
    """Why not, where the config's architecture is one this wheel lists as served only by older vLLM.

    (vLLM would fall back to its generic Transformers backend, which runs no Mamba layer.)"""
    import vllm
    from vllm.model_executor.models import registry

    removed = getattr(registry, "_PREVIOUSLY_SUPPORTED_MODELS", {})
    served = registry._VLLM_MODELS
    for arch in _config(model).get("architectures") or []:
        if arch in removed and arch not in served:
            return (
                f"config.json architectures {arch}: vLLM {vllm.__version__} no longer serves it "
                f"(removed in {removed[arch]}); serve it with vLLM < {removed[arch]}, where this plugin does not run"
            )
    return None


def _missing_field(serve: Any, config: dict[str, Any], exc: BaseException, message: str) -> str | None:
    """vLLM's model code read a config field the config.json does not have."""
    if isinstance(exc, AttributeError) and getattr(exc, "name", None) and "Config' object" in message:
        arch = ",".join(config.get("architectures") or ["?"])
        return (
            f"config.json has no field {exc.name!r}, which vLLM's {arch} code reads; "
            "copy it from the model's published config.json"
        )
    return None


# Config fields holding a nested object that a model's vLLM code indexes without checking
# (a missing one surfaces as "'NoneType' object is not subscriptable" or a bare KeyError).
_NESTED_FIELDS = {
    "KimiLinearForCausalLM": {
        "linear_attn_config": ("full_attn_layers", "kda_layers", "head_dim", "num_heads", "short_conv_kernel_size"),
    },
}


def _missing_nested(serve: Any, config: dict[str, Any], exc: BaseException, message: str) -> str | None:
    """A nested config object (or one of its keys) that vLLM's model code indexes is absent."""
    if not isinstance(exc, (TypeError, KeyError)):
        return None
    for arch in config.get("architectures") or []:
        for name, keys in _NESTED_FIELDS.get(arch, {}).items():
            value = config.get(name)
            if not isinstance(value, dict):
                return (
                    f"config.json field {name!r} is {'null' if name in config else 'missing'}; vLLM's {arch} "
                    f"code needs it as an object with {', '.join(keys)}: copy it from the published config.json"
                )
            absent = [key for key in keys if key not in value]
            if absent:
                return (
                    f"config.json field {name!r} lacks {', '.join(absent)}, which vLLM's {arch} code reads: "
                    "copy it from the published config.json"
                )
    return None


_RULES = [_missing_field, _missing_nested]
