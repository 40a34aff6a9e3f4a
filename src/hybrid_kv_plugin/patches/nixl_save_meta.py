"""Patch ``NixlBaseConnectorScheduler._build_save_meta``: keep Mamba ids whole on the host-buffer save path.

Why: with ``kv_buffer_device="cpu"`` the prefill scheduler tells its workers,
step by step, which newly allocated blocks to stage into the host buffer. It
trims those lists with the same method as the block-id exchange points,
which ``nixl_exchange_clip`` makes strip Mamba scratch slots. A step's list
is only what that step *added*, not a whole table, so stripping "trailing
scratch" there would drop real state blocks from the host buffer.

What it changes: the stock method runs unchanged inside
:func:`hybrid_kv_plugin.nixl.per_step_lists`, where the exchange clip applies
the sliding-window trim only (the behaviour of stock 0.26 and of vLLM 0.27's
``clip_ssm=False``).

Upstream: vLLM 0.27.0 passes ``clip_ssm=False`` from this path to
``get_exchange_clipped_blocks``. First version where the plugin no longer
installs this patch: 0.27.0 (installed together with ``nixl_exchange_clip``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.adapters.capabilities import Feature
from hybrid_kv_plugin.nixl import per_step_lists
from hybrid_kv_plugin.patching import Fingerprint, Installs, PatchSpec

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler:NixlBaseConnectorScheduler._build_save_meta"
PARAMS = ("self", "meta", "scheduler_output")
# Together with ``nixl_exchange_clip``: wherever the plugin backports the SSM-aware exchange (vLLM 0.26).
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "nixl_ssm_slot_pairing"
INSTALLS = Installs(
    when=lambda adapter: adapter.installs_backport(Feature.NIXL_SSM_SLOT_PAIRING), since="0.26.0", removed_in="0.27.0"
)


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="nixl_save_meta",
        target=TARGET,
        fingerprint=Fingerprint(params=PARAMS, exact=True, owner_attrs=("get_sw_clipped_blocks",)),
        build=_wrap,
        why="the per-step host-buffer save lists are partial; the Mamba exchange clip must not strip them",
        upstream="vLLM 0.27.0 get_exchange_clipped_blocks(clip_ssm=False) on the save path",
    )


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def _build_save_meta(self: Any, meta: Any, scheduler_output: Any) -> Any:
        with per_step_lists():
            return original(self, meta, scheduler_output)

    return _build_save_meta
