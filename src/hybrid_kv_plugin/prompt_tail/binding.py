"""One :class:`PromptTailPolicy` per scheduler, shared with its Mamba and full-attention managers.

The value lives on the scheduler (``hybrid_kv_config``, validated before the stock
constructor runs) while the managers are built inside that constructor, so the
policy is bound (to the align Mamba managers and the full-attention ones) the first
time the scheduler splits a prefill chunk - always before the first chunk it
schedules is cached. Managers never bound (a
connector's CPU-side coordinator, a scheduler built without the plugin) keep the
wheel's behaviour.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin._log import log_once
from hybrid_kv_plugin.attention_partial_block import keyable_inside_blocks
from hybrid_kv_plugin.prompt_tail.policy import NATIVE, PromptTailPolicy

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

SCHEDULER_POLICY_ATTR = "hybrid_kv_prompt_tail"
# Read on managers with getattr, never through ``manager.__dict__``: see
# :func:`hybrid_kv_plugin.patching.bypass_inert_patches` for what touching ``__dict__`` costs.
MANAGER_POLICY_ATTR = "hybrid_kv_prompt_tail"


def policy_of(scheduler: Any, adapter: VllmAdapter) -> PromptTailPolicy:
    """The policy of ``scheduler``, binding it (and its Mamba managers) on first use."""
    policy = scheduler.__dict__.get(SCHEDULER_POLICY_ATTR)
    if policy is None:
        policy = _bind(scheduler, adapter)
    return policy


def prompt_tail_bound(manager: Any) -> bool:
    """Whether ``manager`` was bound to a policy that keeps a position (not ``native``)."""
    policy = getattr(manager, MANAGER_POLICY_ATTR, None)
    return policy is not None and policy.active


def _bind(scheduler: Any, adapter: VllmAdapter) -> PromptTailPolicy:
    config = getattr(scheduler, "hybrid_kv_config", None)
    mode = getattr(config, "prompt_tail_checkpoint", NATIVE)
    coordinator = scheduler.kv_cache_manager.coordinator
    if mode != NATIVE and not getattr(coordinator, "enable_partial_hash_hits", False):
        # Sub-block positions are unreachable without partial hash hits: an extra chunk
        # would cost a forward pass and serve nothing.
        log_once(
            logging.INFO,
            "hybrid-kv-plugin: prompt_tail_checkpoint=%s is inactive here: partial hash hits are "
            "disabled (prefix-match unit not finer than the Mamba block)",
            mode,
        )
        mode = NATIVE
    policy = PromptTailPolicy(
        mode=mode,
        hash_block_size=scheduler.hash_block_size,
        eagle_drop=bool(getattr(scheduler, adapter.scheduler_eagle_drop_attr)),
        native_keeps_replay_position=adapter.native_prompt_tail_keeps_replay_position,
        native_eagle_shift=adapter.native_prompt_tail_eagle_shift,
    )
    setattr(scheduler, SCHEDULER_POLICY_ATTR, policy)
    if not policy.active:
        # Managers stay unbound: their patches then call the wheel's method, and vLLM's
        # busiest objects get no attribute they did not have (see bypass_inert_patches).
        return policy
    for manager in coordinator.single_type_managers:
        if getattr(manager, "mamba_cache_mode", None) == "align" or keyable_inside_blocks(manager):
            setattr(manager, MANAGER_POLICY_ATTR, policy)
    return policy
