"""``HybridSimpleCPUConnector``: SimpleCPU CPU offload with fine-grained hybrid prefix hits (seed 000).

Imported by class path only when a user names the connector, never at plugin discovery.
"""
