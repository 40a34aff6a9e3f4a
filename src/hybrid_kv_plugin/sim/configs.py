"""The configurations ``replay`` and ``bench`` compare: which connector, and which of the
plugin's options are on. ``CONFIGS`` maps the name a user passes to ``--configs`` to one."""

from __future__ import annotations

from dataclasses import dataclass

from hybrid_kv_plugin.connector_names import CONNECTOR_NAME, STOCK_CONNECTOR_NAME


@dataclass(frozen=True)
class ReplayConfig:
    name: str
    plugin: bool
    mamba_shared_prefix_checkpoint: bool = False
    prompt_tail_checkpoint: str = "native"
    mamba_output_checkpoint: bool = False
    mamba_divergence_checkpoint: bool = False

    @property
    def connector(self) -> str:
        return CONNECTOR_NAME if self.plugin else STOCK_CONNECTOR_NAME


CONFIGS = {
    "stock": ReplayConfig("stock", plugin=False),
    "plugin": ReplayConfig("plugin", plugin=True),
    "plugin+junction": ReplayConfig("plugin+junction", plugin=True, mamba_shared_prefix_checkpoint=True),
    "plugin+tail-replay": ReplayConfig("plugin+tail-replay", plugin=True, prompt_tail_checkpoint="replay"),
    "plugin+tail-both": ReplayConfig("plugin+tail-both", plugin=True, prompt_tail_checkpoint="both"),
    "plugin+output-checkpoint": ReplayConfig("plugin+output-checkpoint", plugin=True, mamba_output_checkpoint=True),
    "plugin+divergence": ReplayConfig("plugin+divergence", plugin=True, mamba_divergence_checkpoint=True),
}
