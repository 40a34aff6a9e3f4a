"""What ``register()`` does in each vLLM process, exactly once until ``uninstall()``.

:func:`decide` makes the decision (``hybrid-kv doctor`` reports the same one).
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
from enum import StrEnum
from typing import TYPE_CHECKING

from hybrid_kv_plugin._log import forget_logged, log_once
from hybrid_kv_plugin.config import ENV_DISABLE, plugin_disabled
from hybrid_kv_plugin.connector_names import (
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    CONNECTOR_NAME,
    STORE_CONNECTOR_MODULE,
    STORE_CONNECTOR_NAME,
)

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters import AdapterSelection, VllmAdapter
    from hybrid_kv_plugin.patching import PatchMismatch, PatchSpec


class Status(StrEnum):
    """Where ``register()`` left this process (``hybrid-kv doctor`` prints the same words)."""

    UNREGISTERED = "unregistered"  # register() has not run (or uninstall() undid it)
    DISABLED = "disabled"  # HYBRID_KV_PLUGIN_DISABLE is set: vLLM runs stock
    UNSUPPORTED = "unsupported"  # no adapter for the installed vLLM: vLLM runs stock
    MISMATCH = "mismatch"  # a patch target changed shape: nothing patched, vLLM runs stock
    ACTIVE = "active"  # every patch of this process's sides installed, connector registered


@dataclass
class Decision:
    """What the plugin does on this machine, before anything is patched.

    Checked in this order, the first that holds wins: the disable switch, an adapter
    for the installed vLLM, every patch target of the wheel (all sides). ``specs`` (the
    manifest's, all sides) and ``mismatches`` are filled once an adapter is selected.
    """

    status: Status
    reason: str
    selection: AdapterSelection | None = None  # once one was made
    specs: list[PatchSpec] = field(default_factory=list)
    mismatches: list[PatchMismatch] = field(default_factory=list)

    @property
    def adapter(self) -> VllmAdapter | None:
        return self.selection.adapter if self.selection is not None else None


def decide(*, look_past_disable: bool = False) -> Decision:
    """The one decision ``register()`` acts on and ``hybrid-kv doctor`` reports.

    ``look_past_disable``: still select the adapter and check the targets when the
    plugin is disabled (the doctor shows them; the status stays ``disabled``).
    """
    disabled = plugin_disabled()
    why_disabled = f"{ENV_DISABLE} is set"
    if disabled and not look_past_disable:
        return Decision(Status.DISABLED, why_disabled)

    from hybrid_kv_plugin.adapters import select_adapter
    from hybrid_kv_plugin.adapters.detect import SUPPORTED_RANGE
    from hybrid_kv_plugin.patches import patch_specs
    from hybrid_kv_plugin.patching import PatchSet

    selection = select_adapter()
    if selection.adapter is None:
        status = Status.DISABLED if disabled else Status.UNSUPPORTED
        return Decision(status, why_disabled if disabled else selection.reason, selection)
    specs = patch_specs(selection.adapter)
    mismatches = PatchSet(specs).check()
    if disabled:
        return Decision(Status.DISABLED, why_disabled, selection, specs, mismatches)
    if mismatches:
        first = mismatches[0]
        reason = f"patch target {first.target} changed ({first.reason}); supported vLLM {SUPPORTED_RANGE}"
        return Decision(Status.MISMATCH, reason, selection, specs, mismatches)
    return Decision(Status.ACTIVE, selection.reason, selection, specs)


@dataclass
class RegistrationState:
    """Outcome of ``register()`` in this process."""

    status: Status = Status.UNREGISTERED
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
        if STATE.status is not Status.UNREGISTERED:
            return STATE
        _register_locked()
        return STATE


def _register_locked() -> None:
    decision = decide()
    STATE.status, STATE.reason = decision.status, decision.reason
    if decision.status is Status.DISABLED:
        log_once(logging.INFO, "hybrid-kv-plugin: disabled by %s; vLLM runs stock", ENV_DISABLE)
        return
    if decision.status is Status.UNSUPPORTED:
        log_once(logging.WARNING, "hybrid-kv-plugin: inert, %s; vLLM runs stock", decision.reason)
        return
    from hybrid_kv_plugin.patching import PatchSet
    from hybrid_kv_plugin.process_role import current_role

    adapter = decision.adapter
    role = current_role()
    STATE.adapter, STATE.role = adapter, role.value
    if decision.status is Status.MISMATCH:
        log_once(logging.WARNING, "hybrid-kv-plugin: inert, nothing patched: %s", decision.reason)
        return
    patch_set = PatchSet([spec for spec in decision.specs if spec.side in role.sides])
    patch_set.install()  # every target was just checked: all of them go in
    STATE.installs += 1
    STATE.patch_set = patch_set
    STATE.registered_connector = _register_connector()
    log_once(
        logging.INFO,
        "hybrid-kv-plugin: active on %s (%s, %s process, %d of %d patches: %s)",
        decision.reason,
        adapter.name,
        role.value,
        len(patch_set.specs),
        len(decision.specs),
        ", ".join(spec.name for spec in patch_set.specs) or "none",
    )


def _register_connector() -> bool:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return False
    KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_CLASS)
    # Imported only when named: without the `mooncake` extra it refuses at start-up, naming it.
    KVConnectorFactory.register_connector(STORE_CONNECTOR_NAME, STORE_CONNECTOR_MODULE, STORE_CONNECTOR_NAME)
    return True


def uninstall_plugin() -> None:
    """Undo everything ``register()`` did in this process, so it can run again from scratch."""
    with STATE.lock:
        if STATE.patch_set is not None:
            STATE.patch_set.uninstall()
        if STATE.registered_connector:
            from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

            KVConnectorFactory._registry.pop(CONNECTOR_NAME, None)
            KVConnectorFactory._registry.pop(STORE_CONNECTOR_NAME, None)
        STATE.status, STATE.reason, STATE.role = Status.UNREGISTERED, "", ""
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
