"""``HybridSimpleCPUConnector``: SimpleCPU CPU offload with fine-grained hybrid prefix hits.

Imported by class path only when a user names the connector, never at plugin discovery.
"""
