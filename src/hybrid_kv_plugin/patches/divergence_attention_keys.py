"""Patch ``FullAttentionManager._cache_partial_tail_block``: key attention blocks at every unit boundary.

Why: a lookup finds where a request leaves the cached prefix only as precisely as
the attention blocks are keyed - at block ends and at the one prompt-tail position
the wheel keys. In ``align`` mode the attention block equals the Mamba block
(Qwen3-Next: 544 tokens), so every divergence a lookup can see lies on the Mamba
grid, where the wheel already keeps a state, and ``mamba_divergence_checkpoint``
would never find a junction inside a Mamba block to keep (measured on the Mooncake
conversation trace, Qwen3-Next geometry, unit 16: no reuse gained without it).

What it changes: for a full-attention manager bound by ``divergence_bind``, after
the wrapped method (``prompt_tail_attention``, then the wheel's) the block holding
each prefix-match-unit boundary of the prompt computed since the last call gets a
partial prefix-cache key there (:func:`hybrid_kv_plugin.divergence.attention.key_unit_boundaries`),
the way the wheel keys its prompt tail. The lookup already probes every unit
boundary inside the first block that is not a full hit, so the junction it reports
is the divergence to the unit. Unbound managers run the wrapped method only.

Upstream: none yet; installed on 0.29.0-0.33.x.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.divergence.attention import key_unit_boundaries
from hybrid_kv_plugin.divergence.binding import MANAGER_ATTR, divergence_requested
from hybrid_kv_plugin.patching import Fingerprint, Installs, PatchSpec

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = "vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager._cache_partial_tail_block"
PARAMS = ("self", "request", "num_tokens")
# Installed after prompt_tail_attention (same target), which it wraps.
INSTALLS = Installs(when=lambda adapter: adapter.divergence_checkpoint_supported, since="0.29.0")
FEATURE = "mamba_divergence_checkpoint"


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="divergence_attention_keys",
        target=TARGET,
        fingerprint=Fingerprint(params=PARAMS, exact=True),
        build=_wrap,
        why="key attention blocks at every prefix-match-unit boundary so a lookup sees a divergence inside a block",
        upstream="none yet (vLLM keys one attention prompt-tail position)",
        inert_for=lambda manager, scheduler: not divergence_requested(scheduler),
    )


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def _cache_partial_tail_block(self: Any, request: Any, num_tokens: int) -> None:
        result = original(self, request, num_tokens)
        if getattr(self, MANAGER_ATTR, False):
            key_unit_boundaries(self, request, num_tokens)
        return result

    return _cache_partial_tail_block
