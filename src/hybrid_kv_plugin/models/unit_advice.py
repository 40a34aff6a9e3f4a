"""What a finer ``--prefix-match-unit`` would give on a resolved geometry, and what it costs.

vLLM's hybrid models get attention and Mamba blocks of hundreds of tokens (the attention page
must hold one padded Mamba state), and without ``--prefix-match-unit`` the unit is that
block: a prefix is reused in whole blocks only. The finer unit named here is the smallest
divisor of both blocks on the attention kernel's token grid (FlashAttention: multiples of 16)
that vLLM itself accepts for the geometry (checked by resolving it again with that unit).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from hybrid_kv_plugin.models.unit_grid import accepted_units

MIB = 1 << 20


@dataclass(frozen=True)
class UnitAdvice:
    unit: int  # the finest unit vLLM accepts on the kernel grid
    block: int  # the block a hit is rounded down to without it
    hashes_per_block: int  # prefix hashes per block at that unit (1 at unit = block)
    mamba_state_bytes: int  # one Mamba state across all Mamba layers (what a boundary store copies)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return (
            f"--prefix-match-unit {self.unit} is the finest unit vLLM accepts for this geometry: prefix hits every "
            f"{self.unit} tokens instead of every {self.block} (the GPU cache where the wheel keeps Mamba states "
            f"at unit boundaries; the CPU tier with HybridSimpleCPUConnector, fine_grained_hits); it costs "
            f"{self.hashes_per_block} prefix hashes per {self.block}-token block instead of 1, and each Mamba "
            f"state kept at a unit boundary is {self.mamba_state_bytes / MIB:.1f} MiB"
        )


def finer_unit(serve: Any, geometry: Any) -> UnitAdvice | None:
    """The finest unit vLLM accepts below the resolved one, or None where there is none
    (the unit is already on the kernel grid's finest step, or the Mamba cache is not in align mode)."""
    from dataclasses import replace

    from hybrid_kv_plugin.models.geometry import GeometryError, resolve

    if geometry.mamba_cache_mode != "align":
        return None
    block = max(geometry.attention_block_size, geometry.mamba_block_size)
    for unit in accepted_units(geometry):
        if unit >= geometry.hash_block_size:
            return None
        try:
            accepted = resolve(replace(serve, prefix_match_unit=unit), gpu_kv_bytes=geometry.gpu_kv_bytes)
        except GeometryError:
            continue
        return UnitAdvice(
            unit=accepted.hash_block_size,
            block=block,
            hashes_per_block=block // accepted.hash_block_size,
            mamba_state_bytes=geometry.page_bytes * geometry.mamba_layers,
        )
    return None
