"""EvictionGhosts (offload/ghosts.py): the evidence the hybrid order's demotion bet is judged on.

Pure bookkeeping over keys, so plain values stand for the CPU pool's block keys here; the order
that feeds it (what-if lookups on the wheel's coordinator) runs on real schedulers in
tests/test_cpu_tier_eviction.py.
"""

from __future__ import annotations

from hybrid_kv_plugin.offload.ghosts import DEMOTED, MIN_DEMOTED_EVICTIONS, PLAIN, EvictionGhosts


def evict(ghosts: EvictionGhosts, keys, demoted: bool) -> None:
    for key in keys:
        ghosts.evicted_key(key, demoted)


def test_keys_are_remembered_by_class_up_to_capacity():
    ghosts = EvictionGhosts(capacity=4)
    evict(ghosts, ["a", "b", "c"], demoted=False)
    evict(ghosts, ["d", "a", "e"], demoted=True)  # "a" evicted again, now demoted; capacity 4: "b" goes
    assert [ghosts.kind(k) for k in "abcdef"] == [DEMOTED, None, PLAIN, DEMOTED, DEMOTED, None]
    assert len(ghosts) == 4
    ghosts.charge(PLAIN, 32)
    ghosts.charge(DEMOTED, 0)
    ghosts.charge(DEMOTED, -16)  # a what-if lookup that hit less counts nothing
    assert ghosts.totals == {"evicted_plain": 3, "evicted_demoted": 3, "lost_plain": 32, "lost_demoted": 0}


def test_demotion_holds_until_enough_demoted_evictions_are_seen():
    assert [EvictionGhosts(c).min_demoted_evictions for c in (16, 80, 800, 12_850)] == [8, 10, 64, 64]
    ghosts = EvictionGhosts(capacity=10_000)
    evict(ghosts, range(MIN_DEMOTED_EVICTIONS - 1), demoted=True)
    ghosts.charge(DEMOTED, 5_000)  # every token lost to demoted evictions, none to plain ones
    assert ghosts.demotion_pays()
    evict(ghosts, ["last"], demoted=True)
    assert not ghosts.demotion_pays()


def test_the_verdict_compares_tokens_lost_per_evicted_block():
    ghosts = EvictionGhosts(capacity=10_000)
    evict(ghosts, (f"p{i}" for i in range(1000)), demoted=False)
    evict(ghosts, (f"d{i}" for i in range(100)), demoted=True)
    ghosts.charge(PLAIN, 16_000)  # 16 tokens per plain eviction
    ghosts.charge(DEMOTED, 1_600)  # 16 per demoted one: as good a bet as LRU, keep demoting
    assert ghosts.demotion_pays()
    ghosts.charge(DEMOTED, 16)
    assert not ghosts.demotion_pays()
    ghosts.charge(PLAIN, 160)  # plain evictions turn dearer: demoting pays again
    assert ghosts.demotion_pays()


def test_counts_decay_each_window():
    ghosts = EvictionGhosts(capacity=200)
    evict(ghosts, (f"d{i}" for i in range(100)), demoted=True)
    ghosts.charge(DEMOTED, 1_000)
    evict(ghosts, (f"p{i}" for i in range(99)), demoted=False)
    ghosts.charge(PLAIN, 2_000)
    assert (ghosts.evicted, ghosts.lost) == ([99.0, 100.0], [2_000.0, 1_000.0])
    evict(ghosts, ["p99"], demoted=False)  # the 200th eviction: every count halves
    assert (ghosts.evicted, ghosts.lost) == ([50.0, 50.0], [1_000.0, 500.0])
    assert ghosts.totals == {"evicted_plain": 100, "evicted_demoted": 100, "lost_plain": 2_000, "lost_demoted": 1_000}
