"""What ``register()`` does in each vLLM process, exactly once until ``uninstall()``.

Order: honour ``HYBRID_KV_PLUGIN_DISABLE``; select the adapter (unsupported wheel ->
inert, one log line); check *every* patch target of the wheel (mismatch -> inert, one
log line naming the target), then install the patches of the sides this process runs
(:mod:`hybrid_kv_plugin.process_role`: an API server none, a multiprocess worker the
worker side, the engine core and any unnamed process all); then register the
connector name with vLLM's ``KVConnectorFactory`` by class path, so nothing heavy is
imported until a user asks for the connector.

Checking every target in every process keeps the verdict the same across the
processes of one engine: either all of them are patched for their sides, or none is.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from hybrid_kv_plugin import CONNECTOR_NAME
from hybrid_kv_plugin._log import forget_logged, log_once
from hybrid_kv_plugin.config import ENV_DISABLE, plugin_disabled

CONNECTOR_MODULE = "hybrid_kv_plugin.connector.simple_cpu"
CONNECTOR_CLASS = "HybridSimpleCPUConnector"


@dataclass
class RegistrationState:
    """Outcome of ``register()`` in this process; ``status`` is one of
    ``active``, ``disabled``, ``unsupported``, ``mismatch``, or ``unregistered``."""

    status: str = "unregistered"
    reason: str = ""
    role: str = ""
    adapter: object | None = None
    patch_set: object | None = None
    registered_connector: bool = False
    calls: int = 0
    installs: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


STATE = RegistrationState()


def register_plugin() -> RegistrationState:
    with STATE.lock:
        STATE.calls += 1
        if STATE.status != "unregistered":
            return STATE
        _register_locked()
        return STATE


def _register_locked() -> None:
    if plugin_disabled():
        STATE.status, STATE.reason = "disabled", f"{ENV_DISABLE} is set"
        log_once(logging.INFO, "hybrid-kv-plugin: disabled by %s; vLLM runs stock", ENV_DISABLE)
        return

    from hybrid_kv_plugin.adapters import select_adapter
    from hybrid_kv_plugin.adapters.detect import SUPPORTED_RANGE
    from hybrid_kv_plugin.patching import PatchMismatch, PatchSet
    from hybrid_kv_plugin.process_role import current_role

    selection = select_adapter()
    if selection.adapter is None:
        STATE.status, STATE.reason = "unsupported", selection.reason
        log_once(logging.WARNING, "hybrid-kv-plugin: inert, %s; vLLM runs stock", selection.reason)
        return
    adapter = selection.adapter
    role = current_role()
    specs = adapter.patch_specs()
    STATE.role = role.value
    patch_set = PatchSet([spec for spec in specs if spec.side in role.sides])
    try:
        if problems := PatchSet(specs).check():
            raise problems[0]
        patch_set.install()
    except PatchMismatch as exc:
        STATE.status = "mismatch"
        STATE.reason = f"patch target {exc.target} changed ({exc.reason}); supported vLLM {SUPPORTED_RANGE}"
        STATE.adapter = adapter
        log_once(logging.WARNING, "hybrid-kv-plugin: inert, nothing patched: %s", STATE.reason)
        return
    STATE.installs += 1
    STATE.adapter, STATE.patch_set = adapter, patch_set
    STATE.registered_connector = _register_connector()
    STATE.status, STATE.reason = "active", selection.reason
    log_once(
        logging.INFO,
        "hybrid-kv-plugin: active on %s (%s, %s process, %d of %d patches: %s)",
        selection.reason,
        adapter.name,
        role.value,
        len(patch_set.specs),
        len(specs),
        ", ".join(spec.name for spec in patch_set.specs) or "none",
    )


def _register_connector() -> bool:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return False
    KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_CLASS)
    return True


def uninstall_plugin() -> None:
    """Undo everything ``register()`` did in this process, so it can run again from scratch."""
    with STATE.lock:
        if STATE.patch_set is not None:
            STATE.patch_set.uninstall()
        if STATE.registered_connector:
            from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

            KVConnectorFactory._registry.pop(CONNECTOR_NAME, None)
        STATE.status, STATE.reason, STATE.role = "unregistered", "", ""
        STATE.adapter = STATE.patch_set = None
        STATE.registered_connector = False
        STATE.calls = STATE.installs = 0
        forget_logged()


def current_adapter():
    """The adapter ``register()`` selected in this process, selecting one if it has not run."""
    if STATE.adapter is not None:
        return STATE.adapter
    from hybrid_kv_plugin.adapters import select_adapter

    return select_adapter().adapter
