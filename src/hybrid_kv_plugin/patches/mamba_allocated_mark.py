"""Patch ``MambaManager.allocate_new_blocks``: a request that needed no new block is still marked allocated (0.26-0.27).

Why: in ``align`` mode the Mamba manager tells a running request (whose worker block
table is append-only) from a new one by ``_allocated_block_reqs``, which 0.26-0.27 set
only when a call allocates a block. A request whose first allocation needs none - an
external load already placed the state block that its next chunk stays inside (a
fine-grained CPU hit at 160, chunk 160..176 in the 128..192 block) - stays unmarked, so
the copy-on-write of its own prompt-tail state (cached at 176) later takes the new-request
path: the manager swaps the block in place while the worker appends the copy and keeps
reading the old block, which is freed and reused by another request (the byte check:
the randomized soak's ``plugin-fa32`` variant on 0.27.1, seed 0, step 575, and 0.26).

What it changes: after every ``align``-mode call the request is in
``_allocated_block_reqs``, exactly as vLLM 0.28 does on the early return too.

Upstream: vLLM 0.28.0 (``MambaManager.allocate_new_blocks`` marks the request before
returning no blocks). Installed on 0.26-0.27; first version where it is removed: 0.28.0.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.patching import Installs, PatchSpec, ReadsFingerprint

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = "vllm.v1.core.single_type_kv_cache_manager:MambaManager.allocate_new_blocks"
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "vllm_fix"
INSTALLS = Installs(
    when=lambda adapter: not adapter.mamba_marks_requests_allocating_nothing,
    since="0.26.0",
    removed_in="0.28.0",
)


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="mamba_allocated_mark",
        target=TARGET,
        # The stock method still keys the running-request copy-on-write on this set.
        fingerprint=ReadsFingerprint(
            params=("self", "request_id", "num_tokens"),
            self_reads=frozenset({"_allocated_block_reqs", "_partial_hit_reqs", "mamba_cache_mode"}),
            at_least=True,
        ),
        build=_replacement,
        why="a request whose first align-mode allocation needs no block is later copy-on-written as a new one",
        upstream="vLLM 0.28.0 (MambaManager.allocate_new_blocks marks it on the early return)",
    )


def _replacement(original: Any) -> Any:
    @functools.wraps(original)
    def allocate_new_blocks(self: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        blocks = original(self, request_id, *args, **kwargs)
        if self.mamba_cache_mode == "align":
            self._allocated_block_reqs.add(request_id)
        return blocks

    return allocate_new_blocks
