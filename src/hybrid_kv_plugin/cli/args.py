"""What every ``hybrid-kv`` subcommand parses the same way: the parser class (no abbreviations,
errors in one line), the geometry and pool flags of ``replay`` and ``bench``, and the choice of
configurations."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, NoReturn

from hybrid_kv_plugin.cli.errors import fail

CONFIG_NAMES = (
    "stock", "stock+retain-0", "stock+retain-unit", "stock+retain-4units", "stock+retain-block",
    "stock+retain-2blocks", "stock+retain-4blocks", "stock+shared-prefix",
    "plugin", "plugin+junction", "plugin+tail-replay", "plugin+tail-both", "plugin+output-checkpoint",
    "plugin+hybrid-tier", "plugin+divergence", "plugin+divergence+hybrid-tier",
    "plugin+divergence+output-checkpoint+hybrid-tier", "plugin+skip-ends", "plugin+divergence+skip-ends",
    "plugin+divergence+hybrid-tier+skip-ends", "plugin+store-ends",
)
# Stock at its best, in every default run: its retention knob at 0, the unit and the Mamba
# block, and its native shared-prefix checkpoint (a row vLLM refuses costs no run).
DEFAULT_STOCK_CONFIGS = ("stock", "stock+retain-0", "stock+retain-unit", "stock+retain-block", "stock+shared-prefix")
# The plugin as installed, and with its opt-in that pays on every trace measured (docs/features.md):
# a default run shows what switching it on would reuse (0.26-0.28 refuse it: a row, no run).
DEFAULT_PLUGIN_CONFIGS = ("plugin", "plugin+divergence")
COLD_REPLAY_CONFIGS = ("stock", "plugin", "plugin+tail-replay", "plugin+tail-both")


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``SystemExit("hybrid-kv: ...")``, exit 2
    through ``console_main``) and which takes no abbreviation of an option: ``--cpu-block``
    is an error, not ``--cpu-blocks``. The usage is printed by ``--help`` only."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise SystemExit(f"{self.prog}: {message} (see {self.prog} --help)")


# ---------------------------------------------------------------------------- geometry and pools
# On the parsed namespace: the geometry settings whose flag was given (a value equal to the default included).
GIVEN_ATTR = "geometry_flags_given"


class _StoreGiven(argparse.Action):
    """Store the value and note the flag as given: ``--prefix-match-unit 16`` next to ``--model``
    must be refused even though 16 is the default, not silently replaced by the model's unit."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, GIVEN_ATTR, {*getattr(namespace, GIVEN_ATTR, ()), self.dest})


def given_geometry(args: argparse.Namespace) -> set[str]:
    """The ``ReplaySettings`` fields whose flag the command line gave."""
    return set(getattr(args, GIVEN_ATTR, ()))


def add_geometry_arguments(parser: argparse.ArgumentParser) -> None:
    from hybrid_kv_plugin.sim.replay import ReplaySettings as default

    g = parser.add_argument_group("geometry and pools")
    g.add_argument(
        "--attention-block-size", action=_StoreGiven, type=int, default=default.attention_block_size, metavar="N",
        help="full-attention block (tokens)",
    )
    g.add_argument(
        "--mamba-block-size", action=_StoreGiven, type=int, default=default.mamba_block_size, metavar="N",
        help="Mamba block (tokens)",
    )
    g.add_argument(
        "--prefix-match-unit", dest="hash_block_size", action=_StoreGiven, type=int,
        default=default.hash_block_size, metavar="N", help="hash unit of prefix matching",
    )
    g.add_argument(
        "--gpu-blocks", action=_StoreGiven, type=int, default=default.gpu_blocks, metavar="N",
        help="GPU KV-cache blocks",
    )
    g.add_argument(
        "--cpu-blocks", action=_StoreGiven, type=int, default=default.cpu_blocks, metavar="N",
        help="CPU-tier blocks (SimpleCPU pool)",
    )
    eagle = g.add_mutually_exclusive_group()
    eagle.add_argument("--eagle", dest="eagle", action="store_true", default=None, help="EAGLE on in every segment")
    eagle.add_argument("--no-eagle", dest="eagle", action="store_false", help="EAGLE off in every segment")
    g.add_argument(
        "--num-speculative-tokens", action=_StoreGiven, type=int, default=default.num_speculative_tokens, metavar="N"
    )
    g.add_argument(
        "--transfer-delay-steps", action=_StoreGiven, type=int, default=default.transfer_delay_steps, metavar="N",
        help="steps the simulated worker takes to finish a CPU transfer (in-flight stores hold CPU blocks)",
    )


# ReplaySettings field -> the flag that sets it.
SETTINGS_FLAGS = {
    "attention_block_size": "--attention-block-size",
    "mamba_block_size": "--mamba-block-size",
    "hash_block_size": "--prefix-match-unit",
    "gpu_blocks": "--gpu-blocks",
    "cpu_blocks": "--cpu-blocks",
    "num_speculative_tokens": "--num-speculative-tokens",
    "transfer_delay_steps": "--transfer-delay-steps",
}


def settings_from(args: argparse.Namespace) -> Any:
    from hybrid_kv_plugin.sim.replay import ReplaySettings

    for name, flag in SETTINGS_FLAGS.items():
        if getattr(args, name) < (0 if name == "transfer_delay_steps" else 1):
            fail(f"{flag} must be a positive integer")
    return ReplaySettings(**{name: getattr(args, name) for name in SETTINGS_FLAGS})


def choose_configs(names: str | None, segments: Sequence[Any], cold_replay: bool = False) -> list[Any]:
    """The configurations of ``--configs`` (None: the default for these segments)."""
    from hybrid_kv_plugin.sim.configs import CONFIGS

    if names is None and cold_replay:
        chosen = list(COLD_REPLAY_CONFIGS)
    elif names is None:
        chosen = [*DEFAULT_STOCK_CONFIGS, *DEFAULT_PLUGIN_CONFIGS]
        if any(s.eagle for s in segments):
            chosen.append("plugin+junction")
    else:
        chosen = [n.strip() for n in names.split(",") if n.strip()]
        unknown = [n for n in chosen if n not in CONFIGS]
        if unknown or not chosen:
            fail(f"--configs {names!r}: allowed: {', '.join(CONFIG_NAMES)}")
    return [CONFIGS[n] for n in chosen]
