"""The connector names the plugin registers with vLLM, and the stock one its connector extends."""

# What a user writes in ``--kv-transfer-config`` (``"kv_connector"``).
CONNECTOR_NAME = "HybridSimpleCPUConnector"
# Where vLLM's KVConnectorFactory imports it from, only when a user names it.
CONNECTOR_MODULE = "hybrid_kv_plugin.connector.simple_cpu"
CONNECTOR_CLASS = "HybridSimpleCPUConnector"
# The wheel's own SimpleCPU connector, which ``HybridSimpleCPUConnector`` subclasses.
STOCK_CONNECTOR_NAME = "SimpleCPUOffloadConnector"
# The same connector with a Mooncake store behind its CPU tier (optional extra ``mooncake``).
STORE_CONNECTOR_NAME = "HybridMooncakeStoreConnector"
STORE_CONNECTOR_MODULE = "hybrid_kv_plugin.mooncake_store.connector"
