"""Patch ``MambaManager._cache_partial_tail_block``: keep the prompt-tail states the policy names.

Why: the wheel keeps one prompt-tail Mamba state, at the prompt's last hash
boundary (0.29-0.31) or at the last one <= N-1 (0.32+). ``prompt_tail_checkpoint``
``replay`` keeps the <= N-1 state instead (a backport on 0.29-0.31), ``both`` keeps
the two; the ``prompt_tail_split`` patch makes a chunk end at each.

What it changes: for a Mamba manager in ``align`` mode bound to a non-native
policy (:mod:`hybrid_kv_plugin.prompt_tail.binding`), when the chunk being cached
ends at a kept sub-block position the wheel does not keep itself, the state there
is registered the way the wheel registers its own partial tail
(:mod:`hybrid_kv_plugin.mamba_partial_state`: partial key, copy-on-write before the
next forward pass, boundary hand-off to a connector); at the wheel's own position
when the policy does not keep it, nothing is registered (unless it is also the
shared-prefix junction). Every other call, and every unbound manager, runs the
stock method. A state the backend exports inside the chunk (0.30+ internal
checkpoint) is left to the wheel. The junction manager of 0.29 reaches this
through ``super()``.

Upstream: as ``prompt_tail_split`` - none yet; installed on 0.29.0-0.33.x.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.patching import Installs, PatchSpec, ReadsFingerprint
from hybrid_kv_plugin.prompt_tail.binding import MANAGER_POLICY_ATTR, prompt_tail_bound
from hybrid_kv_plugin.mamba_partial_state import KEEP_PARTIAL_STATE_READS, keep_partial_state

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = "vllm.v1.core.single_type_kv_cache_manager:MambaManager._cache_partial_tail_block"
PARAMS = ("self", "request", "num_tokens")
READS = KEEP_PARTIAL_STATE_READS
# Installed together with ``prompt_tail_split``.
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "prompt_tail_checkpoint"
INSTALLS = Installs(when=lambda adapter: adapter.prompt_tail_checkpoint_supported, since="0.29.0")


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="prompt_tail_manager",
        target=TARGET,
        fingerprint=ReadsFingerprint(params=PARAMS, self_reads=READS, at_least=True),
        build=lambda original: _wrap(original, adapter),
        why="keep the prompt-tail Mamba states prompt_tail_checkpoint names (replay, both)",
        upstream="none (vLLM 0.32 keeps one prompt-tail position, at <= N-1)",
        inert_for=lambda manager, _: not prompt_tail_bound(manager),
    )


def _wrap(original: Any, adapter: VllmAdapter) -> Any:
    holds_block = adapter.mamba_partial_tail_producer_holds_block

    @functools.wraps(original)
    def _cache_partial_tail_block(self: Any, request: Any, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
        policy = getattr(self, MANAGER_POLICY_ATTR, None)
        if policy is None or not policy.active:
            if args or kwargs:
                return original(self, request, num_tokens, *args, **kwargs)
            return original(self, request, num_tokens)  # the usual call, without argument packing
        prompt = request.num_prompt_tokens
        if (
            num_tokens > prompt
            or num_tokens % self.block_size == 0
            or adapter.mamba_exports_checkpoint(self, request.request_id)
        ):
            return original(self, request, num_tokens, *args, **kwargs)
        if num_tokens in policy.kept(prompt):
            key = original(self, request, num_tokens, *args, **kwargs)
            if key is not None or request.num_computed_tokens >= num_tokens:
                return key
            return keep_partial_state(self, request, num_tokens, holds_block)
        if num_tokens == policy.dropped(prompt) and num_tokens != request.shared_prefix_boundary:
            return None
        return original(self, request, num_tokens, *args, **kwargs)

    return _cache_partial_tail_block
