"""Patch ``NixlBaseConnectorWorker._apply_prefix_caching``: pair Mamba state slots, or refuse.

Why: the decode worker lines up its own block ids with the prefill's before
it reads. For a Mamba group stock vLLM 0.26 asserts the decode side holds a
single block and takes the prefill list's *last* id - with speculative
decoding a scratch slot, so the state is silently wrong; with multi-slot
tables (prefix caching, ``all`` mode) it asserts or pairs unrelated slots.

What it changes: before the stock method runs, every Mamba group is paired
by :func:`hybrid_kv_plugin.nixl.pair_ssm_slots` (lists already reduced to
state slots by ``nixl_exchange_clip`` on both instances): equal lists pair
1:1; in ``all`` mode a longer prefill list pairs by its tail and a decode
list one slot longer drops the position decode recomputes; anything else
raises :class:`hybrid_kv_plugin.nixl.SsmSlotPairingError` naming the group,
both counts and the fix (run the plugin on both instances). The stock method
then sees equal-length Mamba lists, which it leaves alone, and handles the
attention groups as before.

Upstream: vLLM 0.27.0 replaced the single-block assertion with the "at most
one extra decode slot" pairing. First version where the plugin no longer
installs this patch: 0.27.0.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.adapters.capabilities import Feature
from hybrid_kv_plugin.nixl import ExchangeClip
from hybrid_kv_plugin.patching import Fingerprint, Installs, PatchSpec
from hybrid_kv_plugin.process_role import Side

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker:NixlBaseConnectorWorker._apply_prefix_caching"
# In pull mode (the only caller on 0.26) "local" is decode and "remote" is prefill.
PARAMS = ("self", "local_block_ids", "remote_block_ids", "remote_physical_per_logical")
# Reads kv_cache_config and _has_mamba on the instance (set by __init__).
OWNER_ATTRS = ("_logical_to_kernel_block_ids",)
# The worker half of the backport: wherever the plugin backports the SSM-aware exchange (vLLM 0.26).
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "nixl_ssm_slot_pairing"
INSTALLS = Installs(
    when=lambda adapter: adapter.installs_backport(Feature.NIXL_SSM_SLOT_PAIRING), since="0.26.0", removed_in="0.27.0"
)


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="nixl_worker_pairing",
        target=TARGET,
        # The exact 0.26 signature; any other shape pairs differently.
        fingerprint=Fingerprint(params=PARAMS, exact=True, owner_attrs=OWNER_ATTRS),
        build=_wrap,
        why="the NIXL worker pairs Mamba slots by 'one local block, remote tail'; pair state slots or refuse",
        upstream="vLLM 0.27.0 _apply_prefix_caching SSM pairing (decode - prefill <= 1)",
        side=Side.WORKER,
    )


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def _apply_prefix_caching(
        self: Any, local_block_ids: Any, remote_block_ids: Any, remote_physical_per_logical: int
    ) -> Any:
        if self._has_mamba and len(local_block_ids):
            rules = ExchangeClip.from_kv_cache_config(self.kv_cache_config)
            local_block_ids, remote_block_ids = rules.pair(local_block_ids, remote_block_ids)
        return original(self, local_block_ids, remote_block_ids, remote_physical_per_logical)

    return _apply_prefix_caching
