"""Patch ``Scheduler.__init__``: read and validate the plugin's engine options at start-up.

Why: the plugin's switches travel in ``--additional-config '{"hybrid_kv": {...}}'``
(and ``HYBRID_KV_*`` environment overrides). vLLM itself never looks inside that
section, so without this hook a typo would be silently ignored, and on wheels with
a native field the switch would never reach it.

What it changes: before the stock constructor runs (and so before the
KVCacheManager and its Mamba managers exist), it validates the section
(:class:`hybrid_kv_plugin.config.PluginConfig`; an invalid key or value, the
junction switch on an engine without EAGLE, or a non-native
``prompt_tail_checkpoint`` or ``mamba_output_checkpoint`` on a wheel older than 0.29, or
``mamba_divergence_checkpoint`` on a wheel without it, stops start-up with a message naming
it), maps switches onto the wheel's native
``CacheConfig`` fields through the adapter, and exposes the validated config as
``scheduler.hybrid_kv_config``. After the stock constructor, the per-step methods of
the scheduler and its managers skip the patches whose option is off for this engine
(:mod:`hybrid_kv_plugin.inert_patches`). ``AsyncScheduler`` inherits the patched constructor.

Upstream: none, this is plugin infrastructure; it stays on every supported wheel
(0.26.0-0.33.x).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin._log import log_once
from hybrid_kv_plugin.adapters import first_wheel_where
from hybrid_kv_plugin.config import (
    check_divergence_supported,
    check_output_checkpoint_supported,
    check_prompt_tail_supported,
    check_switch_needs_eagle,
    plugin_config_from,
)
from hybrid_kv_plugin.inert_patches import bypass_inert_patches_of
from hybrid_kv_plugin.patching import Fingerprint, Installs, PatchSpec

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = "vllm.v1.core.sched.scheduler:Scheduler.__init__"
PARAMS = ("self", "vllm_config", "kv_cache_config", "structured_output_manager", "block_size", "hash_block_size")
# Every supported wheel: the plugin's own switches need it.
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "plugin_config"
INSTALLS = Installs(when=lambda adapter: True, since="0.26.0", permanent=True)


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="scheduler_plugin_config",
        target=TARGET,
        fingerprint=Fingerprint(params=PARAMS),
        build=lambda original: _wrap(original, adapter),
        why="validate additional_config['hybrid_kv'] at start-up and map it onto native fields",
        upstream="none (plugin infrastructure)",
    )


def check_wheel_supports(plugin_config: Any, adapter: VllmAdapter) -> None:
    """Options this wheel cannot honour stop start-up (``PluginConfigError``); ``hybrid-kv doctor`` asks the same."""
    check_prompt_tail_supported(
        plugin_config.prompt_tail_checkpoint, adapter.prompt_tail_checkpoint_supported, adapter.version,
        first_wheel_where("prompt_tail_checkpoint_supported"),
    )
    check_output_checkpoint_supported(
        plugin_config.mamba_output_checkpoint, adapter.output_checkpoint_supported, adapter.version,
        first_wheel_where("output_checkpoint_supported"),
    )
    check_divergence_supported(
        plugin_config.mamba_divergence_checkpoint, adapter.divergence_checkpoint_supported, adapter.version,
        first_wheel_where("divergence_checkpoint_supported"),
    )


def _wrap(original: Any, adapter: VllmAdapter) -> Any:
    @functools.wraps(original)
    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        plugin_config = plugin_config_from(getattr(vllm_config, "additional_config", None))
        spec = vllm_config.speculative_config
        check_switch_needs_eagle(
            plugin_config.mamba_shared_prefix_checkpoint, getattr(spec, "method", None), spec is not None and spec.use_eagle()
        )
        check_wheel_supports(plugin_config, adapter)
        if adapter.native_junction_flag_set(vllm_config) and not plugin_config.mamba_shared_prefix_checkpoint:
            log_once(
                logging.INFO,
                "hybrid-kv-plugin: native CacheConfig.%s is set; on vLLM %s it is the same "
                "feature as the plugin's mamba_shared_prefix_checkpoint switch",
                adapter.native_junction_flag,
                adapter.version,
            )
        adapter.apply_native_flags(vllm_config, plugin_config)
        self.hybrid_kv_config = plugin_config
        original(self, vllm_config, *args, **kwargs)
        bypass_inert_patches_of(self, adapter)

    return __init__
