"""Patch ``MambaManager.cache_blocks``: sparse retention keeps the prompt-tail and answer states the plugin names.

Why: with ``prefix_cache_retention_interval`` 0 (the engine default from vLLM
0.30) the Mamba manager hashes a full block only at the ``replay_boundaries`` the
coordinator passes (``N - 1`` without EAGLE). ``prompt_tail_checkpoint=both``
keeps a state at N too; when N is a Mamba block end that state is a full block,
so retention drops it and a continuation of the prompt lands one unit lower.
Likewise ``mamba_output_checkpoint``: an answer's last unit boundary on a Mamba
block end (352 for an answer computed up to 352..367 with Mamba block 32) is never
hashed during decode, so the next turn lands at the previous state.

What it changes: for a Mamba manager bound to a non-native policy
(:mod:`hybrid_kv_plugin.prompt_tail.binding`), ``replay_boundaries`` also holds the
positions the policy keeps for the request's prompt
(:func:`hybrid_kv_plugin.prompt_tail.retention.retained_boundaries`); the stock
method then retains, hashes and offers those blocks to a connector itself. With
dense retention (``None``), an unbound manager or policy ``native`` the call is
unchanged (an engine with neither option on binds its Mamba managers past this patch
where they are already off inline storage: :mod:`hybrid_kv_plugin.inert_patches`).
For one bound to ``mamba_output_checkpoint`` under retention 0, a decode step ending
at an answer block end the option keeps names that position too
(:func:`hybrid_kv_plugin.output_checkpoint.rolling.retained_block_end`), and the
block is recorded with the request's kept answer states, so the next kept
boundary drops it (at most one extra state per running request, as for the
sub-block ones). No model-runner change: the state at N is the one the prompt's
last chunk (or the decode step) wrote into the block ending there.

Upstream: none (vLLM keeps only its own replay boundaries); installed on
0.30.0-0.33.x, where ``cache_blocks`` takes ``replay_boundaries``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.output_checkpoint.binding import MANAGER_ATTR as OUTPUT_CHECKPOINT_ATTR
from hybrid_kv_plugin.output_checkpoint.binding import output_checkpoint_requested
from hybrid_kv_plugin.output_checkpoint.rolling import note_block_end, retained_block_end
from hybrid_kv_plugin.patching import Fingerprint, Installs, PatchSpec
from hybrid_kv_plugin.prompt_tail.binding import MANAGER_POLICY_ATTR, prompt_tail_bound
from hybrid_kv_plugin.prompt_tail.retention import retained_boundaries

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = "vllm.v1.core.single_type_kv_cache_manager:MambaManager.cache_blocks"
PARAMS = ("self", "request", "num_tokens", "retention_interval", "replay_boundaries")
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "prompt_tail_checkpoint"
INSTALLS = Installs(
    when=lambda adapter: adapter.prompt_tail_checkpoint_supported and adapter.mamba_retention_keeps_replay_boundaries,
    since="0.30.0",
)


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="prompt_tail_retention",
        target=TARGET,
        fingerprint=Fingerprint(params=PARAMS, exact=True),
        build=_wrap,
        why="keep the Mamba states prompt_tail_checkpoint and mamba_output_checkpoint name under sparse retention",
        upstream="none (vLLM retains only its own replay boundaries)",
        inert_for=lambda manager, scheduler: not prompt_tail_bound(manager) and not output_checkpoint_requested(scheduler),
    )


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def cache_blocks(
        self: Any, request: Any, num_tokens: int, retention_interval: int | None = None, *, replay_boundaries: Any
    ) -> None:
        policy = getattr(self, MANAGER_POLICY_ATTR, None)
        if policy is not None and retention_interval is not None:
            replay_boundaries = retained_boundaries(policy, request.num_prompt_tokens, replay_boundaries)
        checkpoint = getattr(self, OUTPUT_CHECKPOINT_ATTR, None)
        block_end = None
        if checkpoint is not None:
            block_end = retained_block_end(self, request, num_tokens, checkpoint, retention_interval)
            if block_end is not None:
                replay_boundaries = (*replay_boundaries, block_end)
        result = original(self, request, num_tokens, retention_interval, replay_boundaries=replay_boundaries)
        if block_end is not None:
            note_block_end(self, request, block_end)
        return result

    return cache_blocks
