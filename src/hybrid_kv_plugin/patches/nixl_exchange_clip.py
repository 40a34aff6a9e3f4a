"""Patch ``NixlBaseConnectorScheduler.get_sw_clipped_blocks``: clip Mamba exchange lists too.

Why: on vLLM 0.26 every NIXL block-id exchange point - pull and push,
prefill (``request_finished``) and decode (``update_state_after_alloc``) -
clips sliding-window groups only. A Mamba group goes out whole: null
placeholders, the running state and, under speculative decoding, the trailing
scratch slots. The decode worker then asserts ("SSM can only have one local
block"), or reads a scratch slot as the state, or overwrites its zeroed
scratch with stale prefill bytes.

What it changes: the method every exchange point calls now applies the
plugin's :class:`hybrid_kv_plugin.nixl.ExchangeClip`: sliding-window groups
keep their in-window tail exactly as before; Mamba groups drop their
``num_speculative_blocks`` trailing scratch slots and, in single-state cache
modes, keep only the running state; ``all`` mode keeps its positional slots.
Inside the per-step host-buffer save path (see ``nixl_save_meta``) only the
sliding-window trim applies. Both the prefill and the decode instance must
run the plugin: the two lists are paired slot for slot.

Upstream: vLLM 0.27.0 renamed the method ``get_exchange_clipped_blocks`` and
made it SSM-aware (NIXL Mamba state-slot pairing for multi-slot block
tables). First version where the plugin no longer installs this patch: 0.27.0
(the adapter also skips it on any wheel whose scheduler already has
``get_exchange_clipped_blocks``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.adapters.capabilities import Feature
from hybrid_kv_plugin.nixl import ExchangeClip, ssm_strip_applies
from hybrid_kv_plugin.patching import Fingerprint, Installs, PatchSpec

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler:NixlBaseConnectorScheduler.get_sw_clipped_blocks"
PARAMS = ("self", "block_ids")
# Used by the replacement on the instance: blocks_per_sw, _is_hma_required, kv_cache_config
# (set by __init__, so not checkable on the class); the save path must exist to be exempted.
OWNER_ATTRS = ("_build_save_meta", "request_finished", "update_state_after_alloc")
_CACHE_ATTR = "_hybrid_kv_exchange_clip"
# Wherever the plugin backports the SSM-aware exchange (vLLM 0.26).
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "nixl_ssm_slot_pairing"
INSTALLS = Installs(
    when=lambda adapter: adapter.installs_backport(Feature.NIXL_SSM_SLOT_PAIRING), since="0.26.0", removed_in="0.27.0"
)


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="nixl_exchange_clip",
        target=TARGET,
        # The exact 0.26 signature: 0.27 renamed the method and changed its parameters.
        fingerprint=Fingerprint(params=PARAMS, exact=True, owner_attrs=OWNER_ATTRS),
        build=_wrap,
        why="NIXL exchange lists carry Mamba scratch slots and placeholders; clip them to the state slots",
        upstream="vLLM 0.27.0 get_exchange_clipped_blocks (SSM-aware NIXL exchange clip)",
    )


def exchange_clip_of(scheduler: Any) -> ExchangeClip:
    """The rules of one NIXL scheduler instance, derived once from its own config."""
    clip = scheduler.__dict__.get(_CACHE_ATTR)
    if clip is None:
        clip = ExchangeClip.from_kv_cache_config(scheduler.kv_cache_config, scheduler.blocks_per_sw)
        setattr(scheduler, _CACHE_ATTR, clip)
    return clip


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def get_sw_clipped_blocks(self: Any, block_ids: Any) -> Any:
        # Same early exits as stock: nothing to clip, or a model without HMA groups.
        if len(block_ids) == 0 or not self._is_hma_required:
            return block_ids
        return exchange_clip_of(self).apply(block_ids, strip_ssm=ssm_strip_applies())

    return get_sw_clipped_blocks
