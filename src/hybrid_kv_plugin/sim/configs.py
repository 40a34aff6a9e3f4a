"""The configurations ``replay`` and ``bench`` compare: which connector, and which of the
plugin's options are on. ``CONFIGS`` maps the name a user passes to ``--configs`` to one.

The ``stock…`` configurations are stock vLLM with its own knobs for keeping Mamba states,
at the same GPU and CPU budgets as every other configuration of the run:

- ``stock``: the simulator's engine default, dense retention (a state at every Mamba block
  end a prefill computes; ``prefix_cache_retention_interval`` None);
- ``stock+retain-N``: ``prefix_cache_retention_interval`` set to N, where N is resolved
  against the run's geometry (0, one prefix-match unit, 4 units, one, two or four Mamba
  blocks). 0 keeps only the prompt's replay boundary (and junctions): a server's default
  from 0.29. vLLM refuses an interval off its scheduler block grid at start-up (the Mamba
  block under ``align`` on 0.29+); the row then carries vLLM's message;
- ``stock+shared-prefix``: the wheel's native shared-prefix checkpoint switch
  (``CacheConfig.enable_mamba_shared_prefix_checkpoint``, or 0.30's name for it) on,
  under retention 0. The adapter names the switch; a wheel without one refuses the row.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from hybrid_kv_plugin.connector_names import CONNECTOR_NAME, STOCK_CONNECTOR_NAME


@dataclass(frozen=True)
class Retention:
    """``prefix_cache_retention_interval`` as multiples of the run's geometry (tokens =
    ``units`` prefix-match units + ``mamba_blocks`` Mamba blocks; both 0: interval 0)."""

    units: int = 0
    mamba_blocks: int = 0

    def tokens(self, geometry: Any) -> int:
        return self.units * geometry.hash_block_size + self.mamba_blocks * geometry.mamba_block_size


@dataclass(frozen=True)
class ReplayConfig:
    name: str
    plugin: bool
    mamba_shared_prefix_checkpoint: bool = False
    prompt_tail_checkpoint: str = "native"
    mamba_output_checkpoint: bool = False
    mamba_divergence_checkpoint: bool = False
    # None: the engine's default (dense in the simulator); else the interval it sets.
    retention: Retention | None = None
    # Stock only: the wheel's native shared-prefix checkpoint switch on (the adapter names it).
    native_shared_prefix_checkpoint: bool = False
    # ``kv_connector_extra_config.cpu_tier_eviction`` (plugin only; offload/eviction.py).
    cpu_tier_eviction: str = "lru"
    # ``kv_connector_extra_config.cpu_tier_request_ends`` (plugin only; offload/admission.py).
    cpu_tier_request_ends: str = "auto"

    @property
    def connector(self) -> str:
        return CONNECTOR_NAME if self.plugin else STOCK_CONNECTOR_NAME

    def refusal(self, adapter: Any) -> str | None:
        """Why this wheel cannot run the configuration (None: it can)."""
        if self.native_shared_prefix_checkpoint and not adapter.native_junction_flag:
            return "this vLLM has no native shared-prefix checkpoint switch (CacheConfig, vLLM PR #53945; 0.30+)"
        return None

    def additional_config(self, eagle: bool) -> dict[str, Any] | None:
        """The ``hybrid_kv`` options a server of this configuration sets (None: none).
        An operator sets the junction switch on EAGLE deployments only (elsewhere it is refused)."""
        options: dict[str, Any] = {}
        if self.mamba_shared_prefix_checkpoint and eagle:
            options["mamba_shared_prefix_checkpoint"] = True
        if self.prompt_tail_checkpoint != "native":
            options["prompt_tail_checkpoint"] = self.prompt_tail_checkpoint
        if self.mamba_output_checkpoint:
            options["mamba_output_checkpoint"] = True
        if self.mamba_divergence_checkpoint:
            options["mamba_divergence_checkpoint"] = True
        return {"hybrid_kv": options} if options else None

    def connector_extra_config(self) -> dict[str, Any]:
        """The plugin's connector options this configuration sets (beyond the CPU budget)."""
        if not self.plugin:
            return {}
        options: dict[str, Any] = {}
        if self.cpu_tier_eviction != "lru":
            options["cpu_tier_eviction"] = self.cpu_tier_eviction
        if self.cpu_tier_request_ends != "auto":
            options["cpu_tier_request_ends"] = self.cpu_tier_request_ends
        return options

    def engine_geometry(self, geometry: Any, adapter: Any) -> Any:
        """``geometry`` with this configuration's stock knobs set (the retention interval in
        tokens, the native switch in the CacheConfig)."""
        if self.retention is not None:
            geometry = replace(geometry, prefix_cache_retention_interval=self.retention.tokens(geometry))
        if self.native_shared_prefix_checkpoint and adapter.native_junction_flag:
            extra = {**geometry.extra_cache_config, adapter.native_junction_flag: True}
            geometry = replace(geometry, extra_cache_config=extra)
        return geometry

    @contextlib.contextmanager
    def engine_environment(self, geometry: Any, adapter: Any) -> Iterator[None]:
        """Around building the engine: wheels that read the retention interval from the
        environment (<= 0.28, at coordinator construction) get it there, restored after."""
        name = adapter.retention_interval_env_var
        interval = geometry.prefix_cache_retention_interval
        if name is None or interval is None:
            yield
            return
        before = os.environ.get(name)
        os.environ[name] = str(interval)
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = before


def _stock(name: str, **kwargs: Any) -> ReplayConfig:
    return ReplayConfig(name, plugin=False, **kwargs)


# stock's retention sweep: 0, the unit, a few multiples, the Mamba block (names in CLI order).
STOCK_AT_ITS_BEST = (
    _stock("stock+retain-0", retention=Retention()),
    _stock("stock+retain-unit", retention=Retention(units=1)),
    _stock("stock+retain-4units", retention=Retention(units=4)),
    _stock("stock+retain-block", retention=Retention(mamba_blocks=1)),
    _stock("stock+retain-2blocks", retention=Retention(mamba_blocks=2)),
    _stock("stock+retain-4blocks", retention=Retention(mamba_blocks=4)),
    _stock("stock+shared-prefix", retention=Retention(), native_shared_prefix_checkpoint=True),
)

CONFIGS = {
    "stock": ReplayConfig("stock", plugin=False),
    **{c.name: c for c in STOCK_AT_ITS_BEST},
    "plugin": ReplayConfig("plugin", plugin=True),
    "plugin+junction": ReplayConfig("plugin+junction", plugin=True, mamba_shared_prefix_checkpoint=True),
    "plugin+tail-replay": ReplayConfig("plugin+tail-replay", plugin=True, prompt_tail_checkpoint="replay"),
    "plugin+tail-both": ReplayConfig("plugin+tail-both", plugin=True, prompt_tail_checkpoint="both"),
    "plugin+output-checkpoint": ReplayConfig("plugin+output-checkpoint", plugin=True, mamba_output_checkpoint=True),
    "plugin+hybrid-tier": ReplayConfig("plugin+hybrid-tier", plugin=True, cpu_tier_eviction="hybrid"),
    "plugin+divergence": ReplayConfig("plugin+divergence", plugin=True, mamba_divergence_checkpoint=True),
    "plugin+divergence+hybrid-tier": ReplayConfig(
        "plugin+divergence+hybrid-tier", plugin=True, mamba_divergence_checkpoint=True, cpu_tier_eviction="hybrid"
    ),
    "plugin+divergence+output-checkpoint+hybrid-tier": ReplayConfig(
        "plugin+divergence+output-checkpoint+hybrid-tier", plugin=True, mamba_divergence_checkpoint=True,
        mamba_output_checkpoint=True, cpu_tier_eviction="hybrid",
    ),
    "plugin+skip-ends": ReplayConfig("plugin+skip-ends", plugin=True, cpu_tier_request_ends="skip"),
    "plugin+divergence+skip-ends": ReplayConfig(
        "plugin+divergence+skip-ends", plugin=True, mamba_divergence_checkpoint=True, cpu_tier_request_ends="skip"
    ),
    "plugin+divergence+hybrid-tier+skip-ends": ReplayConfig(
        "plugin+divergence+hybrid-tier+skip-ends", plugin=True, mamba_divergence_checkpoint=True,
        cpu_tier_eviction="hybrid", cpu_tier_request_ends="skip",
    ),
    "plugin+store-ends": ReplayConfig("plugin+store-ends", plugin=True, cpu_tier_request_ends="store"),
}
