"""The connector users name in ``--kv-transfer-config``: ``HybridSimpleCPUConnector``.

It is the wheel's own ``SimpleCPUOffloadConnector`` plus what the plugin offers on
every wheel: validated options (``kv_connector_extra_config``), and the
fine-grained hybrid hit behaviour of vLLM PR #54736, native on 0.30+ and brought
by the adapter layer elsewhere. Being a subclass, it inherits ``SupportsHMA``,
which vLLM requires of any connector used with the hybrid KV-cache manager.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
    SimpleCPUOffloadConnector,
)

from hybrid_kv_plugin.config import connector_options_from
from hybrid_kv_plugin.registration import current_adapter


class HybridSimpleCPUConnector(SimpleCPUOffloadConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        adapter = current_adapter()
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.hybrid_kv_options = connector_options_from(extra, adapter.simplecpu_stock_keys)
        self.hybrid_kv_adapter = adapter
        super().__init__(vllm_config, role, kv_cache_config)
