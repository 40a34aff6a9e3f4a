"""Patch ``KVTransferConfig.has_connector``: let the engine size the CPU pool for ``HybridSimpleCPUConnector`` too.

Why: on vLLM 0.33 the engine core asks every worker for the CPU block count its
SimpleCPU offload tensors really got (``get_simple_cpu_offload_num_blocks``) and
hands the minimum to the scheduler side, so that scheduler and workers agree on
the CPU pool size. The engine decides whether to do that by *name*:
``kv_transfer_config.has_connector("SimpleCPUOffloadConnector")``. The plugin's
connector is a subclass of that class (the worker-side lookup, an ``isinstance``
check, already finds it) but has another name, so without this patch its
scheduler sizes the pool from its own byte budget and may disagree with the
workers.

What it changes: ``has_connector("SimpleCPUOffloadConnector")`` also answers True
when ``HybridSimpleCPUConnector`` is configured (directly or inside a
MultiConnector). Every other question is answered by the original unchanged.
The only caller that asks for the stock SimpleCPU name in 0.33.0 is that
engine-core sizing step.

Upstream: none; the gate is by name in vLLM. Installed from vLLM 0.33.0 (the
first wheel with the gate); never installed on 0.26.0-0.32.x, where the
scheduler side sizes the pool itself.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.connector_names import CONNECTOR_NAME, STOCK_CONNECTOR_NAME
from hybrid_kv_plugin.patching import Fingerprint, Installs, PatchSpec

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = "vllm.config.kv_transfer:KVTransferConfig.has_connector"
# Every wheel whose engine core gates the CPU pool sizing by connector name.
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "fine_grained_cpu_hits"
INSTALLS = Installs(when=lambda adapter: adapter.simplecpu_block_count_gated_by_name, since="0.33.0", permanent=True)


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="offload_has_connector",
        target=TARGET,
        fingerprint=Fingerprint(params=("self", "connector_name"), exact=True, owner_attrs=("kv_connector",)),
        build=_wrap,
        why="the 0.33 engine core sizes the SimpleCPU pool from the workers only for the stock connector name",
        upstream="none (the engine-core gate is by connector name)",
    )


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def has_connector(self: Any, connector_name: str) -> bool:
        if original(self, connector_name):
            return True
        # The plugin's connector *is* a SimpleCPUOffloadConnector (a subclass).
        return connector_name == STOCK_CONNECTOR_NAME and original(self, CONNECTOR_NAME)

    return has_connector
