"""The adapter layer: version detection, family selection, and the capability table per wheel."""

from __future__ import annotations

import pytest

from hybrid_kv_plugin.adapters import ADAPTERS, Feature, adapter_for_family, parse_release, select_adapter
from hybrid_kv_plugin.adapters.detect import InstalledVllm, probe_family
from hybrid_kv_plugin.patches import planned_patches

from helpers import CAPABILITY_TABLE, B, U

# The manifest's patches that add vLLM 0.29's boundary hand-off channel to 0.26-0.28.
HANDOFF_CHANNEL_PATCHES = ("mamba_boundary_handoffs", "boundary_handoff_publish", "truncate_mamba_lookup")
FEATURES = (Feature.FINE_GRAINED_CPU_HITS, Feature.MAMBA_SHARED_PREFIX_CHECKPOINT, Feature.NIXL_SSM_SLOT_PAIRING)


@pytest.mark.parametrize(
    ("raw", "release"),
    [
        ("0.29.0", (0, 29, 0)),
        ("0.29.1+cpu", (0, 29, 1)),
        ("0.33.0rc1", (0, 33, 0)),
        ("0.33.1.dev12+gabc123", (0, 33, 1)),
        ("0.30", (0, 30, 0)),
        ("dev", None),
        ("", None),
    ],
)
def test_parse_release(raw, release):
    assert parse_release(raw) == release


def test_every_family_has_exactly_one_adapter():
    families = [family for cls in ADAPTERS for family in cls.families]
    assert families == [(0, 26), (0, 27), (0, 28), (0, 29), (0, 30), (0, 31), (0, 32), (0, 33)]
    tested = [wheel for cls in ADAPTERS for wheel in cls.tested_wheels]
    assert tested == list(CAPABILITY_TABLE)


@pytest.mark.parametrize("wheel", list(CAPABILITY_TABLE))
def test_capability_table(wheel):
    adapter = adapter_for_family(parse_release(wheel)[:2], wheel)
    assert tuple(adapter.verdict(f).support for f in FEATURES) == CAPABILITY_TABLE[wheel]
    for verdict in adapter.verdicts():
        assert verdict.reason, f"{wheel} {verdict.feature} has no reason"


def test_installed_wheel_selects_its_family(adapter):
    assert adapter.version in CAPABILITY_TABLE
    assert parse_release(adapter.version)[:2] in type(adapter).families


def test_dev_build_is_identified_by_feature_probes(adapter):
    """A build reporting "dev" gets the same adapter as its release, found by probing vLLM itself."""
    assert probe_family() == parse_release(adapter.version)[:2]
    selection = select_adapter(InstalledVllm("dev", None))
    assert type(selection.adapter) is type(adapter)
    assert selection.reason == "vLLM dev via feature probes (the version string carries no release number)"


@pytest.mark.parametrize("raw", ["0.25.1", "0.34.0"])
def test_outside_range_selects_nothing(raw):
    selection = select_adapter(InstalledVllm(raw, parse_release(raw)))
    assert selection.adapter is None
    assert selection.reason == f"vLLM {raw} is outside the supported range >=0.26.0,<0.34.0"


def test_fine_grained_backport_names_the_added_channel():
    for family, version in (((0, 26), "0.26.0"), ((0, 27), "0.27.1"), ((0, 28), "0.28.0")):
        adapter = adapter_for_family(family, version)
        verdict = adapter.verdict(Feature.FINE_GRAINED_CPU_HITS)
        assert (verdict.support, verdict.reason) == (
            B, "this wheel publishes no Mamba boundary handoffs (the plugin adds the vLLM 0.29 channel)"
        )
        names = [p.spec.name for p in planned_patches(adapter) if p.patch in HANDOFF_CHANNEL_PATCHES]
        assert names == [
            "mamba_boundary_handoffs.cache_blocks",
            "mamba_boundary_handoffs.allocate_new_blocks",
            "mamba_boundary_handoffs.pop_blocks_for_free",
            "mamba_boundary_handoffs.new_step_starts",
            "boundary_handoff_publish",
            *(["truncate_mamba_lookup"] if adapter.version.startswith("0.27.") else []),
        ]
    # 0.29 publishes the hand-offs itself: no channel patch.
    planned = planned_patches(adapter_for_family((0, 29), "0.29.0"))
    assert [p.patch for p in planned if p.patch in HANDOFF_CHANNEL_PATCHES] == []


def test_doctor_rows_give_each_feature_one_name():
    from hybrid_kv_plugin.adapters.capabilities import FEATURE_KEYS, FEATURES, PATCH_TAGS, Feature

    # Every adapter verdict appears in exactly one row; keys are unique and double as patch tags.
    assert sorted(r.verdict_of.value for r in FEATURES if r.verdict_of) == sorted(f.value for f in Feature)
    assert len(FEATURE_KEYS) == len(FEATURES) == 7
    assert PATCH_TAGS == FEATURE_KEYS | {"vllm_fix", "plugin_config"}


def test_next_free_block_reads_a_real_pool_without_taking(adapter):
    """``auto`` request-end admission reads the block a CPU pool hands out next: never-used blocks
    in id order (block 0 is the null block), None once nothing is free."""
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=16)
    assert adapter.reads_next_free_block(pool)
    assert adapter.next_free_block(pool).block_id == 1
    assert adapter.next_free_block(pool).block_id == 1  # reading takes nothing
    first, second = pool.get_new_blocks(2)
    assert (first.block_id, second.block_id, adapter.next_free_block(pool).block_id) == (1, 2, 3)
    [third] = pool.get_new_blocks(1)
    assert (third.block_id, pool.get_num_free_blocks(), adapter.next_free_block(pool)) == (3, 0, None)
    pool.free_blocks([second])
    assert adapter.next_free_block(pool) is second
    assert not adapter.reads_next_free_block(object())


def test_free_blocks_at_head_reads_a_real_pool_in_taking_order(adapter):
    """The hybrid CPU-tier order reads which blocks an allocation takes (and whose copies it
    evicts): the pool's own ``get_new_blocks`` takes exactly these, in this order."""
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks=6, enable_caching=True, hash_block_size=16)
    assert [b.block_id for b in adapter.free_blocks_at_head(pool, 3)] == [1, 2, 3]
    assert [b.block_id for b in adapter.free_blocks_at_head(pool, 9)] == [1, 2, 3, 4, 5]  # all that is free
    taken = pool.get_new_blocks(4)
    pool.free_blocks([taken[2], taken[0]])  # where they rejoin the queue is the wheel's choice
    ahead = [b.block_id for b in adapter.free_blocks_at_head(pool, 3)]
    assert sorted(ahead) == [1, 3, 5]
    assert [b.block_id for b in pool.get_new_blocks(3)] == ahead
    assert adapter.free_blocks_at_head(pool, 2) == []
