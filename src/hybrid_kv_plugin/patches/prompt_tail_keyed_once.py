"""Patch ``MambaManager._cache_partial_tail_block``: vLLM's prompt-tail Mamba state is keyed only while its block still holds it.

Why: on 0.26-0.31 the Mamba manager (``align`` mode, prefix-match unit finer than
the Mamba block) keys the running state block at the prompt's last unit boundary B
when a chunk ends there, and the request's next allocation queues a copy-on-write
of it into a fresh block, which the worker runs before the next forward pass.
Under ``AsyncScheduler`` (a GPU ``vllm serve``'s default) a prompt ending exactly at
B has no sampled token yet when its first decode is scheduled, so B is offered to
the manager twice more: by that decode's allocation (``allocate_slots`` caches up
to ``request.num_tokens``, still B) and by the delivery of the prefill's output
(``AsyncScheduler`` caches up to the computed tokens less the placeholders, B
again). By then the decode's forward pass writes the state after B + 1 into that
block, yet the manager keys it again and the next allocation copies it: a second
block under B's key holding the state one token later. The right copy is freed
first, so the prefix cache evicts it first and then serves the wrong one; the CPU
tier stores whichever of the two it is handed (tests/test_prompt_tail_keyed_once.py).
Every prompt of a multiple of the unit that does not end on a Mamba block end.

What it changes: a call for a prompt position the request has already been
scheduled up to or past while it has a sampled token in flight
(``request.num_output_placeholders``, AsyncScheduler's count of them, and
``request.num_computed_tokens >= num_tokens``: the decode being allocated, or one in
flight, overwrites the block before the copy would run) keys nothing and returns
None, as vLLM already does for its shared-prefix position. Without a token in
flight (``Scheduler`` always; a prefill chunk; a boundary reached by a load) the
block still holds the state and the call goes to the wrapped method unchanged, as
do positions past the prompt, Mamba block ends and backend-exported checkpoints
(0.30-0.31). An engine under ``Scheduler`` never has a token in flight: where its
Mamba managers get bindings (inert_patches) they call past this patch.

Upstream: none for the bug; vLLM 0.32 moved its prompt-tail state to the last
boundary <= N-1 (``get_mamba_prefill_checkpoint_position``), which a later prompt
chunk always follows, so it is never keyed again after a decode. Installed on
0.26.0-0.31.x; removed in 0.32.0.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.patching import Installs, PatchSpec, ReadsFingerprint
from hybrid_kv_plugin.scheduler_kind import outputs_arrive_late

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = "vllm.v1.core.single_type_kv_cache_manager:MambaManager._cache_partial_tail_block"
PARAMS = ("self", "request", "num_tokens")
# The stock method keys ``req_to_blocks[...]`` through ``block_pool`` and remembers the
# copy-on-write in ``_partial_hit_reqs``: the bookkeeping this patch keeps from running late.
READS = frozenset({"block_pool", "block_size", "req_to_blocks", "_partial_hit_reqs"})
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "vllm_fix"
INSTALLS = Installs(when=lambda adapter: adapter.native_prompt_tail_keyed_after_its_chunk, since="0.26.0",
                    removed_in="0.32.0")


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="prompt_tail_keyed_once",
        target=TARGET,
        fingerprint=ReadsFingerprint(params=PARAMS, self_reads=READS, at_least=True),
        build=lambda original: _wrap(original, adapter),
        why="under async scheduling the prompt-tail Mamba state is keyed again after a decode overwrote its block",
        upstream="vLLM 0.32 keeps the prompt-tail state at the last boundary <= N-1 (get_mamba_prefill_checkpoint_position)",
        # Only AsyncScheduler puts a sampled token in flight: under Scheduler every call passes through.
        inert_for=lambda _, scheduler: not outputs_arrive_late(scheduler),
    )


def _wrap(original: Any, adapter: VllmAdapter) -> Any:
    @functools.wraps(original)
    def _cache_partial_tail_block(self: Any, request: Any, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
        if (
            request.num_output_placeholders
            and request.num_computed_tokens >= num_tokens
            and num_tokens <= request.num_prompt_tokens
            and num_tokens % self.block_size
            and not adapter.mamba_exports_checkpoint(self, request.request_id)
        ):
            return None
        if args or kwargs:
            return original(self, request, num_tokens, *args, **kwargs)
        return original(self, request, num_tokens)

    return _cache_partial_tail_block
