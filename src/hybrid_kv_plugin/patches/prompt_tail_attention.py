"""Patch ``FullAttentionManager._cache_partial_tail_block``: attention is reachable at every kept sub-block Mamba position.

Why: with an attention block coarser than the prefix-match unit, the attention
group caps a hit at the last position its blocks are keyed at. The wheel keys one
sub-block position, its prompt tail (N's on 0.29-0.31, the last hash boundary
<= N-1 on 0.32+); ``prompt_tail_checkpoint`` ``replay`` / ``both`` and
``mamba_output_checkpoint`` keep Mamba states at other positions, which the
attention group then never reaches (measured with attention block 32, unit 16: a
continuation of N = 336 stops at 320 on 0.32+; a next turn after an answer that
computed up to 349 stops at 320 instead of 336).

What it changes: for a full-attention manager bound to a non-native prompt-tail
policy (:mod:`hybrid_kv_plugin.prompt_tail.binding`), after the stock method the
block holding each kept sub-block prompt-tail position already computed gets a
partial prefix-cache key there
(:func:`hybrid_kv_plugin.prompt_tail.attention.add_partial_keys`); for one bound to
``mamba_output_checkpoint`` (:mod:`hybrid_kv_plugin.output_checkpoint.binding`), a
decode step ending at an answer position the option keeps keys the block holding
it there (a later one in the same block replaces it, as the Mamba side drops the
older state). Keys go on the way the wheel keys its own; the connector stores and
serves them as it does the wheel's. Unbound managers, policy ``native`` with the
option off, run the stock method only.

Upstream: none; installed on 0.29.0-0.33.x with ``prompt_tail_split``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.attention_partial_block import key_attention_block
from hybrid_kv_plugin.output_checkpoint.binding import MANAGER_ATTR as OUTPUT_CHECKPOINT_ATTR
from hybrid_kv_plugin.output_checkpoint.binding import output_checkpoint_requested
from hybrid_kv_plugin.output_checkpoint.rolling import late_boundary
from hybrid_kv_plugin.patching import Fingerprint, Installs, PatchSpec
from hybrid_kv_plugin.prompt_tail.attention import add_partial_keys
from hybrid_kv_plugin.prompt_tail.binding import MANAGER_POLICY_ATTR, prompt_tail_bound

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = "vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager._cache_partial_tail_block"
PARAMS = ("self", "request", "num_tokens")
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "prompt_tail_checkpoint"
INSTALLS = Installs(when=lambda adapter: adapter.prompt_tail_checkpoint_supported, since="0.29.0")


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="prompt_tail_attention",
        target=TARGET,
        fingerprint=Fingerprint(params=PARAMS, exact=True),
        build=_wrap,
        why="key the attention blocks at every sub-block position prompt_tail_checkpoint or mamba_output_checkpoint keeps",
        upstream="none (vLLM keys one attention prompt-tail position)",
        inert_for=lambda manager, scheduler: not prompt_tail_bound(manager) and not output_checkpoint_requested(scheduler),
    )


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def _cache_partial_tail_block(self: Any, request: Any, num_tokens: int) -> None:
        result = original(self, request, num_tokens)
        policy = getattr(self, MANAGER_POLICY_ATTR, None)
        if policy is not None and policy.active:
            add_partial_keys(self, request, num_tokens, policy)
        checkpoint = getattr(self, OUTPUT_CHECKPOINT_ATTR, None)
        # Only a step that computes up to num_tokens (the Mamba side keeps a state there); under
        # AsyncScheduler that boundary is cached a step late, once num_computed_tokens reached it.
        if (
            checkpoint is not None
            and (request.num_computed_tokens < num_tokens
                 or late_boundary(request, num_tokens, checkpoint) is not None)
            and checkpoint.keeps(num_tokens, request.num_prompt_tokens)
        ):
            key_attention_block(self, request, num_tokens)
        return result

    return _cache_partial_tail_block
