"""``kv_connector_extra_config.mooncake_store``: where the master is, and how long a lookup may take.

Invariants: every field is checked at start-up (one message naming the bad field); the
Mooncake package is imported only by :func:`require_mooncake`, whose refusal names what is
missing and how to install it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from hybrid_kv_plugin.config import PluginConfigError

OPTIONS_KEY = "mooncake_store"
INSTALL_HINT = (
    "pip install 'hybrid-kv-plugin[mooncake]' (PyPI mooncake-transfer-engine-non-cuda; "
    "it needs the system library libibverbs.so.1, Debian/Ubuntu: apt-get install libibverbs1)"
)
# The Mooncake client's smallest global segment (0.3.13.post1: below it, setup fails with -600).
MIN_SEGMENT_BYTES = 16 << 20


@dataclass(frozen=True)
class StoreOptions:
    master: str  # host:port of mooncake_master's RPC service
    metadata_server: str  # e.g. http://127.0.0.1:8090/metadata (the master's HTTP metadata server)
    local_hostname: str = "127.0.0.1"  # this engine's transfer endpoint (its segment is served from here)
    protocol: str = "tcp"
    rdma_devices: str = ""
    global_segment_bytes: int = 256 << 20  # what this engine lends the store (its puts live there)
    local_buffer_bytes: int = 64 << 20
    lookup_timeout_ms: int = 1000  # past this a lookup is abandoned; the store owing an answer this long opens the breaker
    retry_s: float = 5.0  # how long the breaker stays open
    max_queued_puts: int = 256  # blocks waiting for the put thread (each pins a CPU-tier block); more are dropped (counted)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> StoreOptions:
        raw = (extra or {}).get(OPTIONS_KEY)
        where = f"kv_connector_extra_config.{OPTIONS_KEY}"
        if not isinstance(raw, Mapping):
            raise PluginConfigError(
                f"invalid hybrid-kv-plugin configuration: {where} is required, "
                '{"master": "HOST:PORT", "metadata_server": "http://HOST:PORT/metadata", ...}'
            )
        known = {f.name: f for f in fields(cls)}
        if unknown := sorted(set(raw) - set(known)):
            raise PluginConfigError(
                f"invalid hybrid-kv-plugin configuration: {where}: unknown key(s) {', '.join(unknown)}; "
                f"allowed: {', '.join(known)}"
            )
        if missing := [name for name in ("master", "metadata_server") if name not in raw]:
            raise PluginConfigError(f"invalid hybrid-kv-plugin configuration: {where}.{missing[0]} is required")
        values: dict[str, Any] = {}
        for name, value in raw.items():
            kind = type(cls.__dataclass_fields__[name].default) if name not in ("master", "metadata_server") else str
            ok = isinstance(value, str) if kind is str else (
                isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
                and (kind is float or isinstance(value, int))
            )
            if not ok:
                expected = "a string" if kind is str else f"a positive {kind.__name__}"
                raise PluginConfigError(f"invalid hybrid-kv-plugin configuration: {where}.{name}: {value!r} is not {expected}")
            values[name] = value
        if values.get("global_segment_bytes", MIN_SEGMENT_BYTES) < MIN_SEGMENT_BYTES:
            raise PluginConfigError(
                f"invalid hybrid-kv-plugin configuration: {where}.global_segment_bytes: {values['global_segment_bytes']} "
                f"is below {MIN_SEGMENT_BYTES} (16 MiB), the Mooncake client's smallest segment"
            )
        return cls(**values)


def require_mooncake() -> Any:
    """The store client class, or the start-up refusal naming what is missing."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as err:
        raise PluginConfigError(
            f"HybridMooncakeStoreConnector needs the Mooncake store client, which does not import here ({err}); "
            f"install it: {INSTALL_HINT}"
        ) from None
    return MooncakeDistributedStore


def mooncake_missing() -> str:
    """Empty where the store client imports, else why not (for ``hybrid-kv doctor``)."""
    try:
        require_mooncake()
    except PluginConfigError as err:
        return str(err)
    return ""


def doctor_row() -> dict[str, str]:
    """``hybrid-kv doctor``'s row: whether ``HybridMooncakeStoreConnector`` can start in this environment."""
    missing = mooncake_missing()
    return {
        "feature": "mooncake_store_tier",
        "title": "Mooncake store behind the CPU tier, shared by engines (HybridMooncakeStoreConnector)",
        "option": '--kv-transfer-config \'{"kv_connector": "HybridMooncakeStoreConnector", '
        '"kv_connector_extra_config": {"mooncake_store": {"master": ..., "metadata_server": ...}}}\'',
        "support": "unavailable" if missing else "plugin",
        "reason": missing or "the Mooncake store client imports; hits follow the CPU-tier row above",
    }
