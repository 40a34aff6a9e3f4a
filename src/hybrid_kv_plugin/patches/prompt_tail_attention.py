"""Patch ``FullAttentionManager._cache_partial_tail_block``: attention is reachable at every kept prompt-tail position.

Why: with an attention block coarser than the prefix-match unit, the attention
group caps a hit at the last position its blocks are keyed at. The wheel keys one
sub-block prompt-tail position (N's on 0.29-0.31, the last hash boundary <= N-1 on
0.32+); ``prompt_tail_checkpoint`` ``replay`` / ``both`` keep Mamba states at
other positions, which the attention group then never reaches (measured with
attention block 32, unit 16: a continuation of N = 336 stops at 320 on 0.32+).

What it changes: for a full-attention manager bound to a non-native policy
(:mod:`hybrid_kv_plugin.prompt_tail.binding`), after the stock method the block
holding each kept sub-block position already computed gets a partial prefix-cache
key there (:func:`hybrid_kv_plugin.prompt_tail.attention.add_partial_keys`), the
way the wheel keys its own. The connector stores and serves those keys as it does
the wheel's. Unbound managers and policy ``native`` run the stock method only.

Upstream: none; installed on 0.29.0-0.33.x with ``prompt_tail_split``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.patching import Fingerprint, Installs, PatchSpec
from hybrid_kv_plugin.prompt_tail.attention import add_partial_keys
from hybrid_kv_plugin.prompt_tail.binding import MANAGER_POLICY_ATTR

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = "vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager._cache_partial_tail_block"
PARAMS = ("self", "request", "num_tokens")
INSTALLS = Installs(when=lambda adapter: adapter.prompt_tail_checkpoint_supported, since="0.29.0")


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="prompt_tail_attention",
        target=TARGET,
        fingerprint=Fingerprint(params=PARAMS, exact=True),
        build=_wrap,
        why="key the attention blocks at every prompt-tail position prompt_tail_checkpoint keeps",
        upstream="none (vLLM keys one attention prompt-tail position)",
    )


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def _cache_partial_tail_block(self: Any, request: Any, num_tokens: int) -> None:
        result = original(self, request, num_tokens)
        policy = self.__dict__.get(MANAGER_POLICY_ATTR)
        if policy is not None and policy.active:
            add_partial_keys(self, request, num_tokens, policy)
        return result

    return _cache_partial_tail_block
