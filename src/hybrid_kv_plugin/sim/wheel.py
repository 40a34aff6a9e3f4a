"""Build what the wheel's engine would build, for a simulator that runs no model.

Each helper reads adapter facts (never version numbers) to build a vLLM object
the way the installed wheel's own engine or worker builds it: the KV-cache
tensor layout, the resolved block sizes, the request block hasher, the EAGLE
group marks, the blocks the KV-cache manager pins on its own, and the Mamba
boundary hand-offs a step published. Feature code never needs these; only
``hybrid_kv_plugin.sim`` and the tests do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.models.kv_plan import resolve_block_sizes as resolve_block_sizes  # the engine's own resolution

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters import VllmAdapter


def make_kv_cache_tensor(adapter: VllmAdapter, size: int, layer_names: list[str], page_size: int) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheTensor

    if adapter.kv_cache_tensor_style == "shared_by":
        return KVCacheTensor(size=size, shared_by=list(layer_names))
    # Groups overlay one allocation: every layer starts at offset 0, one page per block.
    return KVCacheTensor(size=size, layers=list(layer_names), layer_stride=0, block_stride=page_size)


def request_block_hasher(adapter: VllmAdapter, vllm_config: Any, hash_block_size: int) -> Any:
    """The per-request hasher built the way the wheel's EngineCore builds it."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    if adapter.hashes_lookahead_tokens:
        return get_request_block_hasher(hash_block_size, hash_fn, vllm_config.num_hash_lookahead_tokens)
    return get_request_block_hasher(hash_block_size, hash_fn)


def mark_eagle_groups(
    adapter: VllmAdapter, vllm_config: Any, kv_cache_config: Any, draft_layers: frozenset[str]
) -> None:
    """Flag ``is_eagle_group`` on the groups the wheel's engine would flag for this model.

    0.26-0.32 flag nothing for plain EAGLE on a non-DeepSeek-V4 model (0.26-0.28 only know
    the DeepSeek-V4 MTP layer; 0.29-0.32 ``_annotate_eagle_groups`` reads a DSpark-only spec
    marker), so their coordinators fall back to treating every group as an EAGLE group.
    """
    if not adapter.eagle_groups_follow_draft_layers:
        return
    # Under EAGLE block drop, a group is an EAGLE group exactly when it holds a draft layer.
    speculative_config = vllm_config.speculative_config
    if speculative_config is None or not speculative_config.use_eagle_block_drop():
        return
    for group in kv_cache_config.kv_cache_groups:
        group.is_eagle_group = not draft_layers.isdisjoint(group.layer_names)


def eagle_block_drop_options(adapter: VllmAdapter) -> dict[str, Any]:
    """SpeculativeConfig fields that keep EAGLE on the trailing-block drop.

    Up to 0.32 EAGLE always drops the last matched prefix-cache unit; where request
    hashes include the drafter's lookahead token (0.33) that token proves the boundary
    instead, and EAGLE drops nothing unless told not to.
    """
    if adapter.hashes_lookahead_tokens:
        return {"disable_lookahead_block_hashes": True}
    return {}


def junction_active(adapter: VllmAdapter, scheduler: Any) -> bool:
    """Whether the junction checkpoint is in effect on ``scheduler`` (switch on and gate open)."""
    if adapter.native_junction_scheduler_attr:
        return bool(getattr(scheduler, adapter.native_junction_scheduler_attr))
    from hybrid_kv_plugin.junction import plan_of

    return plan_of(scheduler).enabled


def partial_tail_pins(adapter: VllmAdapter, kv_cache_manager: Any) -> list[Any]:
    """GPU blocks the KV-cache manager itself pins beyond the block tables.

    0.27-0.28 offer a producer's prompt-tail copy as ``SchedulerOutput.partial_tail_offloads``
    to a producer-side connector and hold one reference on it until the request's blocks
    are freed (``KVCacheManager._partial_tail_pins``); other wheels pin nothing.
    """
    if not adapter.kv_cache_manager_pins_partial_tails:
        return []
    return [block for blocks in kv_cache_manager._partial_tail_pins.values() for block in blocks]


def boundary_handoffs_published(adapter: VllmAdapter) -> bool:
    """Whether scheduler outputs carry the hand-offs now: natively (0.29+), or on 0.26-0.28
    while the plugin's channel patch (``boundary_handoff_publish``) is installed."""
    if adapter.has_boundary_handoffs or not adapter.boundary_handoff_patch_needed:
        return adapter.has_boundary_handoffs
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler

    from hybrid_kv_plugin.patching import is_patched

    return is_patched(inspect.getattr_static(Scheduler, "_build_kv_connector_meta"))


def boundary_handoffs(adapter: VllmAdapter, scheduler_output: Any) -> dict[str, list[int]]:
    """Mamba boundary states one step published, as ``{req_id: [num_tokens, ...]}``
    (``{}`` on wheels without the hand-off channel, or without a connector).

    0.26-0.28 have the channel only while the plugin's hand-off patches are installed."""
    if not (adapter.has_boundary_handoffs or adapter.boundary_handoff_patch_needed):
        return {}
    block_state = getattr(scheduler_output, "kv_connector_block_state", None)
    if block_state is None:
        return {}
    return {
        req_id: [num_tokens for _group, _block, num_tokens in entries]
        for req_id, entries in block_state.boundary_state_offloads.items()
    }


def byte_check_models(adapter: Any, has_connector: bool) -> bool:
    """Whether the wheel, as patched in this process, serves the bytes :mod:`sim.byte_cache` checks.

    Not where the scheduler takes the deepest KV-cache group's local hit for a request
    looked up with a connector (0.26) and the plugin's ``connector_hit_reconcile`` is not
    installed: stock vLLM 0.26 then starts requests from Mamba blocks nobody wrote (a vLLM
    bug, pinned in ``tests/test_byte_cache.py``); a byte check would only find it again.
    """
    if not (has_connector and adapter.connector_lookup_takes_deepest_group):
        return True
    import inspect

    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator

    from hybrid_kv_plugin.patching import is_patched

    return is_patched(inspect.getattr_static(HybridKVCacheCoordinator, "find_longest_cache_hit_per_group"))
