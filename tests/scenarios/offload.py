"""Small SimEngine scenarios for SimpleCPU offload, shared by the offload, byte-check and reliability tests.

Every scenario drives the installed wheel's real scheduler, KV-cache manager and
connector; :class:`~hybrid_kv_plugin.sim.invariants.OffloadInvariants` watches
each offload engine and is checked when the scenario ends.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hybrid_kv_plugin.connector_names import CONNECTOR_NAME
from hybrid_kv_plugin.sim import HybridGeometry, SimEngine
from hybrid_kv_plugin.sim.invariants import OffloadInvariants

# 4 MiB: 4096 CPU blocks of the tiny model's 1 KiB pages, 16x its 256 GPU blocks.
CPU_BYTES = 1 << 22
# Tokens appended to a replayed prompt: they are never cached anywhere.
CONTINUATION = (3, 4, 5)


@dataclass
class OffloadRun:
    engine: SimEngine
    invariants: OffloadInvariants
    _ids: itertools.count

    def request(self, prompt: Sequence[int], max_tokens: int = 1) -> int:
        """Run one request to completion; its hit (tokens it did not compute)."""
        req_id = f"r{next(self._ids)}"
        return self.engine.run([(req_id, prompt)], max_tokens=max_tokens)[req_id]

    def external_tokens(self, req_id: str) -> int:
        return self.engine.outcomes[req_id].external_tokens


def offload_engine(
    adapter: Any,
    connector: str = CONNECTOR_NAME,
    *,
    geometry: HybridGeometry | None = None,
    extra: dict[str, Any] | None = None,
    configure: Callable[[Any], None] | None = None,
    byte_check: bool | None = None,
) -> OffloadRun:
    engine = SimEngine(
        geometry or HybridGeometry(),
        adapter=adapter,
        kv_connector=connector,
        kv_connector_extra_config={"cpu_bytes_to_use": CPU_BYTES, **(extra or {})},
        configure=configure,
        byte_check=byte_check,
    )
    return OffloadRun(engine, OffloadInvariants(engine), itertools.count())


def cpu_tier_hit(
    run: OffloadRun, prompt: Sequence[int], *, max_tokens: int = 4, warm: Sequence[Sequence[int]] = (),
    replay: Sequence[int] | None = None,
) -> int:
    """Serve ``prompt``, evict the GPU prefix cache, then ``warm`` prompts, then ``replay`` (default:
    prompt + 3 new tokens).

    The last request's hit can only come from the CPU tier (plus whatever ``warm``
    left in the GPU cache). Invariants are checked before returning.
    """
    run.request(prompt, max_tokens=max_tokens)
    assert run.engine.reset_prefix_cache(), "the GPU prefix cache must be resettable once idle"
    for earlier in warm:
        run.request(earlier)
    hit = run.request([*prompt, *CONTINUATION] if replay is None else replay)
    run.invariants.check()
    return hit


def gpu_local_hit(adapter: Any, prompt: Sequence[int], *, geometry: HybridGeometry | None = None,
                  max_tokens: int = 4, configure: Callable[[Any], None] | None = None,
                  replay: Sequence[int] | None = None) -> int:
    """The same replay without a connector and without the reset: what the GPU cache alone serves."""
    engine = SimEngine(geometry or HybridGeometry(), adapter=adapter, configure=configure)
    engine.run([("a", prompt)], max_tokens=max_tokens)
    return engine.run([("b", [*prompt, *CONTINUATION] if replay is None else replay)])["b"]


# 2 KiB pages under attention block 32: a CPU tier of 80 blocks (79 past the null block).
REQUEST_ENDS_TIER_BYTES = 80 * 2048


class RequestEndsTier:
    """One engine with an 80-block CPU tier and ``cpu_tier_request_ends: ends`` (attention block 32
    unless ``geometry`` says otherwise); ``request`` runs a prompt to completion and returns its hit."""

    def __init__(self, adapter: Any, ends: str, additional_config: dict | None = None,
                 geometry: HybridGeometry | None = None, **extra: Any) -> None:  # fmt: skip
        self.engine = SimEngine(
            geometry or HybridGeometry(attention_block_size=32),
            adapter=adapter,
            kv_connector=CONNECTOR_NAME,
            kv_connector_extra_config={"cpu_bytes_to_use": REQUEST_ENDS_TIER_BYTES, "cpu_tier_request_ends": ends, **extra},
            additional_config=additional_config,
        )
        assert len(self.engine.offload_manager.cpu_block_pool.blocks) == 80
        self.invariants = OffloadInvariants(self.engine)
        self._ids = itertools.count()

    def request(self, prompt: Sequence[int]) -> int:
        req_id = f"r{next(self._ids)}"
        hit = self.engine.run([(req_id, prompt)], max_tokens=1)[req_id]
        self.invariants.check()
        return hit

    def reset_gpu(self) -> None:
        assert self.engine.reset_prefix_cache(), "the GPU prefix cache must be resettable once idle"

    def held(self) -> int:
        """CPU blocks holding a copy (keyed)."""
        return sum(block.block_hash is not None for block in self.engine.offload_manager.cpu_block_pool.blocks)

    def declined(self) -> tuple[int, int] | None:
        """(Mamba states, attention partial tails) the admission declined; None: no admission attached.
        The connector's boundary-store counters count each declined state once, as an outcome."""
        admission = self.engine.connector.request_end_admission
        stats = self.engine.connector.get_boundary_store_stats()
        assert stats.published == sum(v for k, v in stats.as_dict().items() if k != "published")
        if admission is None:
            assert stats.declined_request_end == 0
            return None
        assert stats.declined_request_end == admission.declined_states
        return admission.declined_states, admission.declined_partial_tails
