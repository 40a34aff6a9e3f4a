"""NIXL P/D: which Mamba state slots an exchange carries, and how the two sides pair them.

A hybrid request's block table holds, per KV-cache group, more ids than a
prefill (P) -> decode (D) transfer may touch: sliding-window groups keep blocks
outside the window, and Mamba groups carry null placeholders, the superseded
state of an earlier step and, under speculative decoding, trailing scratch
slots. vLLM 0.26's NIXL connector ships these lists unclipped for Mamba and
the worker then pairs the wrong slots (or asserts). This package is the
plugin's own logic for the fix that vLLM 0.27.0 ships natively:

* :mod:`.clip` - per group, the ids a scheduler puts on the wire;
* :mod:`.pairing` - how the worker lines up its own state slots with the
  peer's, refusing (never guessing) when they cannot belong together.

Nothing here imports vLLM or the ``nixl`` library at module import time; the
patches in ``hybrid_kv_plugin.patches.nixl_*`` wire it into vLLM.
"""

from hybrid_kv_plugin.nixl.clip import ExchangeClip, GroupRule, per_step_lists, ssm_strip_applies
from hybrid_kv_plugin.nixl.pairing import SsmSlotPairingError, pair_ssm_slots

__all__ = [
    "ExchangeClip",
    "GroupRule",
    "SsmSlotPairingError",
    "pair_ssm_slots",
    "per_step_lists",
    "ssm_strip_applies",
]
