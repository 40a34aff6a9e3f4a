"""Patch ``Scheduler._mamba_block_aligned_split``: every prefill chunk but the prompt's last ends on the Mamba block grid.

Why: in ``align`` mode the Mamba manager caches table slot ``p`` as the state after
exactly ``(p + 1) * block_size`` tokens, and the runner writes a state only where a
chunk ends. vLLM 0.26's split keeps chunk ends on the grid only below the last
position a GPU hit can resume from, which EAGLE (and MTP) lowers by one block. Above
it, when concurrent prefills share the token budget, a chunk ends mid-block; its
slot keeps that state, the next chunk crosses the block's end, and the slot is
cached as the state at the block's end. Every later request resuming there (a GPU
hit once the request's answer fills the next attention block, or a CPU-tier hit)
starts from a truncated state: wrong tokens, no error. Found by the byte-checked
soak with EAGLE on (0.26.0, ``stock`` seed 0: q8's chunk 64..102 of a 156-token
prompt left the state after 102 tokens in its slot 1, cached as the state at 128;
q19 resumed from it at step 178).

What it changes: the wheel's split still decides the chunk; a chunk of the prompt
that starts inside a Mamba block and would run past that block's end is cut there,
so the slot it continues is written with the block-end state before it is cached.
Below the wheel's limit its own stops already do this, so without EAGLE nothing
changes (above the limit only the prompt's last, partial block remains). Upstream
also floors a budget-limited chunk end to the grid; the plugin keeps 0.26's chunk
and only adds the stop, which is enough for the invariant and never leaves a
request waiting for budget.

Upstream: vLLM PR #51113 ("Keep mamba align prefill chunks block-aligned past
last_cache_position", the correctness half of issue #43559), in 0.27.0; adapter fact
``mamba_split_aligns_below_cache_limit_only``. Installed on 0.26.x; removed in 0.27.0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.chunk_stop import SPLIT_TARGET, stock_split_fingerprint, wrap_split
from hybrid_kv_plugin.patching import Installs, PatchSpec
from hybrid_kv_plugin.scheduler_kind import drafts_with_eagle

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

TARGET = SPLIT_TARGET
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "vllm_fix"
INSTALLS = Installs(
    when=lambda adapter: adapter.mamba_split_aligns_below_cache_limit_only, since="0.26.0", removed_in="0.27.0"
)


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="mamba_split_keeps_block_grid",
        target=TARGET,
        fingerprint=stock_split_fingerprint(adapter),
        build=lambda original: wrap_split(original, _stop),
        why="a prefill chunk ending mid-block above EAGLE's resume limit leaves a state its slot is later cached as",
        upstream="vLLM PR #51113 (0.27.0)",
        # Without an EAGLE-family drafter the wheel's limit is the prompt's last block end, above
        # which no block end remains to cross: the stop never fires, so such an engine skips it.
        inert_for=lambda scheduler, _: not drafts_with_eagle(scheduler),
    )


def block_end_stop(scheduler: Any, request: Any, start: int, end: int) -> int | None:
    """The end of the Mamba block a prompt chunk resumes inside, if the chunk would run past it."""
    if start >= max(request.num_prompt_tokens, request.num_tokens - 1):
        return None  # decode (drafts included) and resumed outputs: not a prefill split
    block_size = scheduler.cache_config.block_size
    if not start % block_size:
        return None
    boundary = (start // block_size + 1) * block_size
    return boundary if boundary < end else None


def _stop(scheduler: Any, request: Any, start: int, end: int) -> int | None:
    return block_end_stop(scheduler, request, start, end)  # looked up per call: a test ablates it
