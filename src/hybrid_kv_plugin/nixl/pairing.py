"""Worker-side pairing of one Mamba group's state slots between decode (D) and prefill (P).

After the exchange clip (:mod:`.clip`) each side holds only state-bearing
slots. What may still differ, and why:

* single-state modes: nothing. Each side holds exactly its running state, so
  the lists pair 1:1. A longer list means that side did not clip - in practice
  a peer running stock vLLM 0.26 without this plugin - and pairing "the last
  slot" would copy a scratch slot: refused.
* ``all`` mode, one state per block position:
  - P longer: P also holds positions that D already has from its own prefix
    cache, so D's slots pair with P's *tail*;
  - D longer by one: D's last slot is the position D recomputes itself (P
    stops one token short for Mamba models), it receives nothing;
  - D longer by more: no consistent alignment exists: refused.

Refusing is deliberate: a wrong pairing silently corrupts generation, an
error stops one transfer with a message that says what to fix.
"""

from __future__ import annotations

from collections.abc import Sequence

# Shown with every refusal: the usual cause is a P/D pair where only one side clips.
_REMEDY = (
    "hybrid-kv-plugin must run on both the prefill and the decode instance "
    "(or both must be on vLLM >= 0.27, which clips natively)"
)


class SsmSlotPairingError(AssertionError):
    """Mamba state slots of a P/D transfer cannot be paired without copying the wrong state.

    An ``AssertionError`` on purpose: vLLM >= 0.27 reports this condition with a
    plain ``assert`` in the same place, so code that handles the native failure
    handles the plugin's too.
    """


def pair_ssm_slots(
    group: int, decode: Sequence[int], prefill: Sequence[int], *, positional: bool
) -> tuple[list[int], list[int]]:
    """Return ``(decode, prefill)`` of equal length, slot i of one receiving slot i of the other."""
    decode, prefill = list(decode), list(prefill)
    n_decode, n_prefill = len(decode), len(prefill)
    if not positional and max(n_decode, n_prefill) > 1:
        side = "prefill" if n_prefill > 1 else "decode"
        raise SsmSlotPairingError(
            f"Group {group}: unpairable SSM state slots, decode={n_decode} prefill={n_prefill}: "
            f"a single-state Mamba cache exchanges exactly one slot, but the {side} list was "
            f"not clipped to its running state; {_REMEDY}"
        )
    if n_decode - n_prefill > 1:
        raise SsmSlotPairingError(
            f"Group {group}: unpairable SSM state slots, decode={n_decode} prefill={n_prefill}: "
            "decode may hold at most one slot more than prefill (the position it recomputes); "
            f"refusing to pair unrelated Mamba states; {_REMEDY}"
        )
    if n_decode < n_prefill:
        # Explicit start index: a zero-length tail must stay empty (prefill[-0:] is everything).
        prefill = prefill[n_prefill - n_decode :]
    elif n_decode > n_prefill:
        decode = decode[:n_prefill]
    return decode, prefill
