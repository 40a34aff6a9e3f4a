"""Patch ``Scheduler.__init__``: bind ``mamba_divergence_checkpoint`` (open the junction gate without EAGLE).

Why: with ``--mamba-cache-mode align`` and a prefix-match unit finer than the Mamba
block, a request whose lookup finds attention KV past the deepest Mamba state
learns where the attention hit ends (``request.shared_prefix_boundary``). Only
under EAGLE does any wheel end a chunk exactly there and keep the Mamba state (the
0.29 junction backport, vLLM 0.30+ natively: their gates require an EAGLE group);
without it the stop is floored to the grid and no state is kept, so the next
request sharing the prefix resumes up to a whole Mamba block lower (Qwen3-Next:
544-token blocks).

What it changes: after the constructor (``scheduler_plugin_config`` and
``output_checkpoint_bind`` included) returns, with the option on, the junction
gate (:func:`hybrid_kv_plugin.junction.junction_plan`: partial hash hits, no
multi-module MTP re-prefill tail; no EAGLE group needed) decides: on 0.29 the
junction backport's plan opens, on 0.30+ the wheel's gate attributes are set on
the scheduler, its KV-cache manager and its align Mamba managers
(:func:`hybrid_kv_plugin.divergence.bind`). Where it opens, the full-attention
managers are bound to unit keys (``divergence_attention_keys``). The wheel's (or
the backport's) split and Mamba manager then do the rest. Option off: nothing.
``AsyncScheduler`` inherits the constructor.

Upstream: none yet (vLLM PR #53945 gates the junction checkpoint on EAGLE);
installed on 0.29.0-0.33.x. 0.26-0.28 refuse the option at start-up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.divergence import bind
from hybrid_kv_plugin.divergence.native import NativeGateFingerprint
from hybrid_kv_plugin.patching import Fingerprint, Installs, PatchSpec, then_call

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = "vllm.v1.core.sched.scheduler:Scheduler.__init__"
PARAMS = ("self", "vllm_config", "kv_cache_config", "structured_output_manager", "block_size", "hash_block_size")
INSTALLS = Installs(when=lambda adapter: adapter.divergence_checkpoint_supported, since="0.29.0")
FEATURE = "mamba_divergence_checkpoint"


def spec(adapter: VllmAdapter) -> PatchSpec:
    gate, manager = adapter.native_junction_scheduler_attr, adapter.native_junction_manager_attr
    return PatchSpec(
        name="divergence_bind",
        target=TARGET,
        # Native gate: the constructors must still store the attributes it sets.
        fingerprint=NativeGateFingerprint(params=PARAMS, gate_attr=gate, manager_attr=manager)
        if gate and manager
        else Fingerprint(params=PARAMS),
        build=lambda original: _wrap(original, adapter),
        why="open the junction stop and state without EAGLE for mamba_divergence_checkpoint",
        upstream="none yet (vLLM PR #53945 gates the junction checkpoint on EAGLE)",
    )


def _wrap(original: Any, adapter: VllmAdapter) -> Any:
    return then_call(original, lambda scheduler: bind(scheduler, adapter))
