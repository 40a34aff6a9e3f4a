"""The wheel's own KV-cache planning, as its engine core runs it before the first step.

``get_kv_cache_groups`` / ``get_kv_cache_config_from_groups`` live in
``vllm.v1.core.kv_cache_utils`` up to 0.32 and in ``vllm.v1.core.kv_cache_planning``
from 0.33 on, with the same signatures. The model geometry (``models.geometry``) and the
simulator (``sim``) both plan through here, so a block size or unit means the same in both.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters import VllmAdapter


def kv_cache_planner() -> ModuleType:
    """The wheel module holding ``get_kv_cache_groups`` and ``get_kv_cache_config_from_groups``."""
    for name in ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "get_kv_cache_config_from_groups") and hasattr(module, "get_kv_cache_groups"):
            return module
    raise ImportError("this vLLM has no get_kv_cache_config_from_groups in v1.core")


def resolve_layout(vllm_config: object, backend: type, specs: dict) -> None:
    """Fix the KV-cache layout the engine core fixes before planning (wheels that have one)."""
    utils = importlib.import_module("vllm.v1.attention.backends.utils")
    resolve = getattr(utils, "resolve_kv_cache_layout", None)
    if resolve is None:
        return  # older wheels plan without a resolved layout
    supported = [layout.name for layout in utils.get_supported_kv_cache_layouts([backend])]
    layout = resolve(vllm_config, [supported], list(specs.values()))
    cache_config = vllm_config.cache_config  # type: ignore[attr-defined]
    if cache_config.kv_cache_layout is None:
        utils.record_kv_cache_layout(cache_config, layout.name)


def resolve_block_sizes(adapter: VllmAdapter, kv_cache_config: Any, vllm_config: Any) -> tuple[int, int]:
    """(scheduler block size, hash block size), recorded where the wheel's engine records them.

    vLLM's own resolution, so it also refuses a prefix-match unit the wheel would refuse."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    if adapter.kv_cache_config_carries_hash_sizes:
        from vllm.v1.core.kv_cache_utils import resolve_cache_hit_alignment_tokens

        kv_cache_config.hash_block_size = hash_block_size
        kv_cache_config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
            kv_cache_config, vllm_config, scheduler_block_size, hash_block_size
        )
    return scheduler_block_size, hash_block_size
