"""hybrid-kv-plugin: hybrid (attention + Mamba) prefix-cache fixes for stock vLLM.

vLLM discovers :func:`register` through the ``vllm.general_plugins`` entry point
and calls it in every process (API server, engine core, workers), possibly more
than once. Importing this package is cheap: nothing from vLLM is imported until
:func:`register` runs.
"""

from hybrid_kv_plugin.connector_names import CONNECTOR_NAME

__version__ = "0.1.0.dev0"


def register() -> None:
    """vLLM general-plugin hook: cheap, re-entrant, never raises for an unsupported wheel."""
    from hybrid_kv_plugin.registration import register_plugin

    register_plugin()


def uninstall() -> None:
    """Restore every vLLM attribute the plugin patched and forget the registration."""
    from hybrid_kv_plugin.registration import uninstall_plugin

    uninstall_plugin()


__all__ = ["CONNECTOR_NAME", "__version__", "register", "uninstall"]
