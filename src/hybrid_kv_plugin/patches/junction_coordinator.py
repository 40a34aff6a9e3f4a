"""Patch ``kv_cache_coordinator.HybridKVCacheCoordinator``: the coordinator that owns the junction plan.

Why: the junction checkpoint (see ``junction_split``) needs a Mamba manager that
keeps a partial state at the junction and at the lowered EAGLE prompt tail, a
single gate shared with the scheduler, and - under sparse prefix-cache retention -
replay boundaries that know EAGLE resumes one block lower than the last prompt
token (vLLM 0.26-0.29 hand every manager ``num_prompt_tokens - 1``).

What it changes: the module global is replaced by a subclass of the wheel's own
class; ``get_kv_cache_coordinator`` reads that global at call time, so every hybrid
coordinator built while the plugin is installed is one. Its constructor runs the
stock one, then turns the stock ``MambaManager`` instances it built into the
plugin's subclass (:mod:`hybrid_kv_plugin.junction.manager`). vLLM's KV-cache spec
registry is not touched: it is re-populated at every engine start and asserts on a
manager other than ``MambaManager`` for ``MambaSpec``. Until a scheduler binds the
coordinator with the switch on and the gate open, coordinator and managers behave
exactly like the stock classes (a connector's CPU-side coordinator is never bound).

Upstream: vLLM PR #53945 (``HybridKVCacheCoordinator.get_replay_boundaries``,
``MambaManager._cache_partial_tail_block`` junction case, the gate in
``KVCacheManager``). First version where the plugin no longer installs this patch:
0.30.0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybrid_kv_plugin.junction.coordinator import junction_coordinator_class
from hybrid_kv_plugin.junction.fingerprints import CoordinatorFingerprint, MambaManagerShape
from hybrid_kv_plugin.adapters.capabilities import Feature
from hybrid_kv_plugin.patching import Installs, PatchSpec

if TYPE_CHECKING:
    from hybrid_kv_plugin.adapters.base import VllmAdapter

MANAGERS_MODULE = "vllm.v1.core.single_type_kv_cache_manager"
TARGET = "vllm.v1.core.kv_cache_coordinator:HybridKVCacheCoordinator"
# Constructor parameters shared by 0.26-0.29 (0.28 appends num_prefill_lookahead).
PARAMS = (
    "kv_cache_config",
    "max_model_len",
    "max_in_flight_tokens",
    "use_eagle",
    "enable_caching",
    "enable_kv_cache_events",
    "dcp_world_size",
    "pcp_world_size",
    "scheduler_block_size",
    "hash_block_size",
)
# Instance attributes the plan, the adoption and the replay hand-off read.
STORED = ("eagle_group_ids", "enable_partial_hash_hits", "single_type_managers", "retention_interval", "scheduler_block_size")
# Wherever the plugin backports the junction checkpoint (no native CacheConfig flag).
# The feature this patch serves, or vllm_fix (adapters.capabilities; doctor groups by it).
FEATURE = "mamba_shared_prefix_checkpoint"
INSTALLS = Installs(
    when=lambda adapter: adapter.installs_backport(Feature.MAMBA_SHARED_PREFIX_CHECKPOINT), since="0.26.0", removed_in="0.30.0"
)


def spec(adapter: VllmAdapter) -> PatchSpec:
    return PatchSpec(
        name="junction_coordinator",
        target=TARGET,
        fingerprint=CoordinatorFingerprint(
            params=PARAMS,
            attrs=("cache_blocks", "verify_and_split_kv_cache_groups"),
            stored_attrs=STORED + adapter.junction_coordinator_extra_attrs,
            manager=MambaManagerShape(MANAGERS_MODULE, adapter.mamba_partial_tail_reads),
        ),
        build=lambda original: junction_coordinator_class(original, _stock_mamba_manager(), adapter),
        why="own the junction plan; adopt Mamba managers that checkpoint at the junction",
        upstream="vLLM PR #53945",
    )


def _stock_mamba_manager() -> Any:
    import importlib

    return importlib.import_module(MANAGERS_MODULE).MambaManager
