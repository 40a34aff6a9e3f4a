"""Patch ``Scheduler._build_kv_connector_meta``: hand the Mamba boundary states to the KV connector.

Why: vLLM 0.29 drains the Mamba ``align`` boundary hand-offs every scheduling step
and offers them to the connector as
``scheduler_output.kv_connector_block_state.boundary_state_offloads``
(``{request id: [(group id, block id, boundary tokens), ...]}``), only while the
connector builds its metadata. 0.26-0.28 have no such channel; the plugin's
fine-grained SimpleCPU scheduler reads exactly that attribute.

What it changes: before the stock call, the hand-offs the patch
``mamba_boundary_handoffs`` recorded during this pass are drained from every
manager of the scheduler's KV-cache coordinator and set on the scheduler output
as ``kv_connector_block_state`` (:class:`BoundaryHandoffState`, same field name
and entry shape as 0.29). Like 0.29 they are not filtered by request liveness (the
consumer does that). The attribute is removed again after the call, so the output
the workers receive is the stock one. ``AsyncScheduler`` inherits the method.

Upstream: vLLM 0.29.0 (``KVConnectorBlockState``, ``Scheduler.schedule`` drains
``take_boundary_state_offloads``), the prerequisite of PR #54736. Installed on
0.26.0-0.28.x only; first version where it is removed: 0.29.0.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.patches.mamba_boundary_handoffs import take_handoffs
from hybrid_kv_plugin.patching import Installs, PatchSpec, ReadsFingerprint

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = "vllm.v1.core.sched.scheduler:Scheduler._build_kv_connector_meta"
ATTRIBUTE = "kv_connector_block_state"
# Together with ``mamba_boundary_handoffs``: wherever the plugin adds the hand-off channel.
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "fine_grained_cpu_hits"
INSTALLS = Installs(when=lambda adapter: adapter.boundary_handoff_patch_needed, since="0.26.0", removed_in="0.29.0")


@dataclass
class BoundaryHandoffState:
    """The connector-only block state of one step (the field of vLLM 0.29's ``KVConnectorBlockState`` it needs)."""

    # {request id: [(KV-cache group id, GPU block id, boundary tokens), ...]}
    boundary_state_offloads: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="boundary_handoff_publish",
        target=TARGET,
        # The stock method only forwards the output to the connector.
        fingerprint=ReadsFingerprint(params=("self", "connector", "scheduler_output"), exact=True, self_reads=frozenset()),
        build=_wrap,
        why="offer the recorded Mamba boundary states to the KV connector with each step's output",
        upstream="vLLM 0.29.0 KVConnectorBlockState.boundary_state_offloads (prerequisite of PR #54736)",
    )


def drain(kv_cache_manager: Any) -> dict[str, list[tuple[int, int, int]]]:
    """This pass's hand-offs of every manager, per request, in 0.29's entry shape."""
    offloads: dict[str, list[tuple[int, int, int]]] = {}
    for manager in kv_cache_manager.coordinator.single_type_managers:
        for req_id, group_id, block, boundary_tokens in take_handoffs(manager):
            offloads.setdefault(req_id, []).append((group_id, block.block_id, boundary_tokens))
    return offloads


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def _build_kv_connector_meta(self: Any, connector: Any, scheduler_output: Any) -> Any:
        setattr(scheduler_output, ATTRIBUTE, BoundaryHandoffState(drain(self.kv_cache_manager)))
        try:
            return original(self, connector, scheduler_output)
        finally:
            # Connector-only state: the workers get the stock output. ``delattr``, not
            # ``__dict__``: touching that moves the output's fields off CPython's fast path.
            if hasattr(scheduler_output, ATTRIBUTE):
                delattr(scheduler_output, ATTRIBUTE)

    return _build_kv_connector_meta
