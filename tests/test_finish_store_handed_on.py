"""A store queued when a request finishes is dropped if its GPU block was handed to a request with the same prefix.

The CPU tier's finish-time stores (the attention block holding a request's end) are pinned
only when the next step sends them (``offload/fine_grained_scheduler.py`` on 0.26-0.29, patch
``finish_store_pinning`` on 0.30+), so between the finish and that step the block can be
evicted and reallocated. A request with the same prefix that gets it keys it again, when it is
scheduled, with keys equal to the ones the store was queued under: the check before sending
compares the key objects, not their values, or the copy reads a block the new request writes.

Real scheduler, KV-cache manager and ``HybridSimpleCPUConnector`` of each wheel; attention and
Mamba blocks of 32 tokens, unit 16. Request ``a`` ends at 464 inside attention block 448..480
(its prompt's last unit boundary with ``prompt`` 470 tokens; its newest answer state with
``answer``: 448 + 30 answer tokens under ``mamba_output_checkpoint``), so that block is queued
at finish with its key at 464. ``w`` runs beside it with other tokens, so free blocks follow
a's in the pool's queue. The pool is arranged as it was in the soak where this was found
(``plugin-hybrid-tier-fa64`` seed 25, 0.33.0): the blocks ahead of a's queued block are held
and a's Mamba state past 448 is evicted, so ``b`` (a's first 464 tokens + 10 of its own) hits
448 and takes the queued block for 448..480, keyed at 464 again before the store goes out.
Transfers complete two steps after they are issued (the byte check sees b's decode write).
"""

from __future__ import annotations

import pytest

from hybrid_kv_plugin.config import PluginConfigError
from hybrid_kv_plugin.sim import HybridGeometry
from hybrid_kv_plugin.sim.engine import SAMPLED_TOKEN

from helpers import tokens
from scenarios.output_checkpoint import keys_compared_by_value, queued_finish_store_blocks, turn_engine

GEOMETRY = HybridGeometry(attention_block_size=32, mamba_block_size=32)
# (a's prompt, its answer tokens, b's tokens shared with a) per request end
ENDS = {"prompt": (tokens(470), 2, tokens(464)), "answer": (tokens(448), 30, tokens(448) + [SAMPLED_TOKEN] * 16)}
OWN = list(range(600, 610))
# The step whose connector metadata sends a's queued store: a's last step + 1 (0.32+ end a
# prompt's prefill one unit below its end, one more step before the answer).
SENT_AT = {"prompt": {}, "answer": {"0.32.0": 32, "0.33.0": 32}}


def _hand_on(adapter, end: str) -> tuple[int, int, list[int], list[str]]:
    """(b's hit, a's queued block, b's attention blocks from 448 on, the byte check's violations)."""
    from vllm.v1.core.kv_cache_utils import get_group_id

    prompt, answer, shared = ENDS[end]
    engine = turn_engine(adapter, True if end == "answer" else None, GEOMETRY).engine
    pool = engine.gpu_block_pool
    engine.add_request("a", prompt, max_tokens=answer)
    engine.add_request("w", [t + 7 for t in prompt], max_tokens=answer)
    while engine.scheduler.has_unfinished_requests():
        engine.step()
    queued = queued_finish_store_blocks(engine.offload_manager)
    assert len(queued) == 2  # a's block keyed at 464, and w's
    free = pool.free_block_queue.get_all_free_blocks()
    at = [block.block_id for block in free].index(queued[0])
    never_used = [block for block in free if block.block_hash is None]
    ahead = [block for block in free[:at] if block.block_hash is not None]  # a's Mamba states
    pool.evict_blocks({b.block_id for b in ahead if get_group_id(b.block_hash) == 1 and b.block_hash_num_tokens > 448})
    pool.touch(ahead)
    held = pool.get_new_blocks(len(never_used))
    assert pool.free_block_queue.get_all_free_blocks()[0].block_id == queued[0]
    engine.transfers.delay_steps = 2
    engine.add_request("b", shared + OWN, max_tokens=2)
    engine.step()
    attention = engine.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    taken = [block.block_id for block in attention.req_to_blocks["b"][14:]]
    while engine.has_work():
        engine.step()
    pool.free_blocks(held + ahead)
    return engine.outcomes["b"].hit_tokens, queued[0], taken, engine.byte_cache.violations


def _compare_keys_by_value(adapter, monkeypatch) -> None:
    """Ablate the plugin's identity check (not vLLM code) on the wheel's path: equal keys pass."""
    if adapter.has_native_fine_grained_cpu_hits:
        from hybrid_kv_plugin.patches import finish_store_pinning as checking
    else:
        from hybrid_kv_plugin.offload import fine_grained_scheduler as checking
    monkeypatch.setattr(checking, "carries_key_objects", keys_compared_by_value)


@pytest.mark.both_schedulers
@pytest.mark.parametrize("end", ["prompt", "answer"])
def test_queued_finish_store_of_a_block_handed_on_is_dropped(plugin, adapter, scheduling, monkeypatch, end):
    if end == "answer" and not adapter.output_checkpoint_supported:
        with pytest.raises(PluginConfigError, match=r"hybrid_kv\.mamba_output_checkpoint: true needs vLLM >= 0\.29\.0"):
            turn_engine(adapter, True, GEOMETRY)
        return
    hit, block, taken, violations = _hand_on(adapter, end)
    assert (hit, taken, violations) == (448, [block], [])
    _compare_keys_by_value(adapter, monkeypatch)
    hit, block, taken, violations = _hand_on(adapter, end)
    # AsyncScheduler learns of a's finish one step later.
    issued = SENT_AT[end].get(adapter.version, 30 if end == "answer" else 4) + (scheduling == "async")
    assert (hit, taken) == (448, [block])
    assert violations == [
        f"step {issued + 2}: store issued at step {issued}: source GPU blocks [{block}] changed while it was in flight"
    ]
