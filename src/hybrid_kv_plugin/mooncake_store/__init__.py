"""A Mooncake store as a second tier behind the plugin's SimpleCPU tier (``HybridMooncakeStoreConnector``).

Only :mod:`.options` and :mod:`.tier` import without vLLM; :mod:`.connector` is imported by
vLLM's connector factory when a user names the connector.
"""
