"""``mamba_divergence_checkpoint``: keep the Mamba state where a request's cached attention prefix ends.

In Mamba ``align`` mode a hit is the shortest over all KV-cache groups, so a request
whose lookup finds attention KV past the deepest Mamba state it can load recomputes
from that state. vLLM records where the attention hit ended
(``request.shared_prefix_boundary``, the longest single-group hit) and stops a prefill
chunk there only floored to the Mamba block grid (up to a whole Mamba block lower:
543 tokens on Qwen3-Next), or exactly there only under EAGLE (vLLM PR #53945). With
the option on, the prefill ends a chunk exactly at that point (a prefix-match-unit
multiple: hits land on unit boundaries) and the Mamba manager keeps the state found
there under its partial prefix-cache key, so the next request sharing the prefix
resumes there. The kept state is a partial tail like the wheel's own: copied out
before the next forward pass and handed to a connector, so the CPU tier stores it.

Cost per request whose lookup diverged inside a Mamba block: at most one extra
prefill chunk and one extra Mamba block in the GPU prefix cache (evictable; one stored
state on the CPU tier); per computed prompt unit, one attention partial key. Under
``AsyncScheduler`` the 0.29 backport also counts, at admission, the block the chunk after
the kept state copies it into (:mod:`hybrid_kv_plugin.junction.manager`).

It is the junction checkpoint without the EAGLE gate; the same pieces do it:

* vLLM 0.29: the junction backport (:mod:`hybrid_kv_plugin.junction`), whose plan opens
  for this option without an EAGLE group (patches ``junction_coordinator`` /
  ``junction_split``);
* vLLM 0.30+: the wheel's own junction stop and manager case, whose gate requires an
  EAGLE group; :mod:`.native` opens it without one.

Either way the gate is :func:`hybrid_kv_plugin.junction.junction_plan` (partial hash
hits, no multi-module MTP re-prefill tail), read by the split and the manager alike,
and bound once per scheduler (:mod:`.binding`, patch ``divergence_bind``). So that a
lookup sees a divergence inside an attention block at all, the full-attention blocks
are keyed at every unit boundary (:mod:`.attention`, patch ``divergence_attention_keys``),
and again where a preempted request recomputes (patch ``divergence_keys_after_preemption``).
Wheels without the option (0.26-0.28) refuse it at start-up (``scheduler_plugin_config``).
"""

from hybrid_kv_plugin.divergence.binding import MANAGER_ATTR, bind, divergence_requested
from hybrid_kv_plugin.divergence.native import open_native_gate

__all__ = ["MANAGER_ATTR", "bind", "divergence_requested", "open_native_gate"]
