"""One module per patch of vLLM. Each module documents, where it lives: why the patch
exists, what it changes, the upstream change that makes it unnecessary, and the first
vLLM version on which the plugin no longer installs it. Modules export ``spec(adapter)``
returning a :class:`hybrid_kv_plugin.patching.PatchSpec`; the adapter decides which apply.
"""
