"""``cpu_tier_eviction: "hybrid"``: the CPU tier's eviction order for a hybrid model (offload/eviction.py).

Real scheduler, KV-cache manager and ``HybridSimpleCPUConnector`` of the installed wheel, a
CPU tier small enough to evict: each case is one where the wheel's LRU loses a hit that the
hybrid order keeps, measured under both. 0.26-0.29 run the plugin's backport, 0.30+ the
wheel's own SimpleCPU scheduler: the same numbers on every wheel. Where the connector runs the
stock SimpleCPU scheduler (``fine_grained_hits: false`` up to 0.29) the option is refused.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from hybrid_kv_plugin.adapters import Feature, Support
from hybrid_kv_plugin.config import PluginConfigError
from hybrid_kv_plugin.connector_names import CONNECTOR_NAME
from hybrid_kv_plugin.offload.mode import OffloadMode
from hybrid_kv_plugin.sim import HybridGeometry, SimEngine
from hybrid_kv_plugin.sim.engine import SAMPLED_TOKEN
from hybrid_kv_plugin.sim.invariants import OffloadInvariants

from scenarios.offload import CONTINUATION

# 1 KiB pages (FA 16 / Mamba 64, unit 16): a CPU tier of 80 blocks (79 past the null block).
PAGE_BYTES = 1024
SMALL_TIER = 80 * PAGE_BYTES
REFUSED = (
    "invalid hybrid-kv-plugin configuration: kv_connector_extra_config.cpu_tier_eviction: 'hybrid' "
    "needs the fine-grained hybrid SimpleCPU connector"
)


def tokens(n: int, seed: int) -> list[int]:
    """``n`` token ids of one conversation (different seeds share no block)."""
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


class Tier:
    """One engine with an 80-block CPU tier; ``request`` runs a prompt to completion and returns its hit."""

    def __init__(self, adapter, policy: str, geometry: HybridGeometry | None = None,
                 additional_config: dict | None = None):
        self.engine = SimEngine(
            geometry or HybridGeometry(),
            adapter=adapter,
            kv_connector=CONNECTOR_NAME,
            kv_connector_extra_config={"cpu_bytes_to_use": SMALL_TIER, "cpu_tier_eviction": policy},
            additional_config=additional_config,
        )
        self.invariants = OffloadInvariants(self.engine)
        self._ids = itertools.count()

    def request(self, prompt, max_tokens: int = 1) -> int:
        req_id = f"r{next(self._ids)}"
        return self.engine.run([(req_id, prompt)], max_tokens=max_tokens)[req_id]

    def reset_gpu(self) -> None:
        assert self.engine.reset_prefix_cache(), "the GPU prefix cache must be resettable once idle"


def _reuse_from_gpu(adapter, policy: str) -> tuple[int, int]:
    """A conversation reused from the GPU cache while newer work fills the tier.

    A (320 tokens: 20 attention blocks and 2 prompt-tail states, 22 CPU blocks) is stored, X
    after it; A's next turn reuses A from the GPU cache; Y and Z push 9 blocks out of the tier.
    With the GPU cache reset, A's third turn hits what the tier kept. Returns
    (the second turn's hit, the third turn's hit).
    """
    tier = Tier(adapter, policy)
    assert len(tier.engine.offload_manager.cpu_block_pool.blocks) == 80
    a = tokens(320, seed=0)
    tier.request(a)
    tier.request(tokens(320, seed=1))  # X
    second = tier.request([*a, *CONTINUATION])
    tier.request(tokens(320, seed=2))  # Y
    tier.request(tokens(320, seed=3))  # Z
    tier.reset_gpu()
    third = tier.request([*a, *CONTINUATION])
    tier.invariants.check()
    return second, third


def _chunked_prompt(adapter, policy: str) -> int:
    """Prompts prefilled in chunks of 64 tokens hand off a Mamba state at every chunk end; each
    one supersedes the previous. A, B, C (336 tokens: 21 attention blocks, states at 64..320)
    and D (160 tokens) push 11 blocks out of the tier. With the GPU cache reset, A's next turn
    hits what the tier kept."""
    tier = Tier(adapter, policy, HybridGeometry(max_num_batched_tokens=64))
    a = tokens(336, seed=0)
    tier.request(a)
    tier.request(tokens(336, seed=1))
    tier.request(tokens(336, seed=2))
    tier.request(tokens(160, seed=3))
    tier.reset_gpu()
    hit = tier.request([*a, *CONTINUATION])
    tier.invariants.check()
    return hit


ANSWER = 120


def _answer_states(adapter, policy: str) -> int:
    """``mamba_output_checkpoint`` keeps a state at every unit of an answer (A: prompt 320, 120
    tokens decoded: states at 336..432, each superseding the one before). X, Y (320) and Z (64)
    push 6 blocks out of the tier. With the GPU cache reset, A's next turn (prompt + answer +
    new text) hits what the tier kept."""
    tier = Tier(adapter, policy, additional_config={"hybrid_kv": {"mamba_output_checkpoint": True}})
    a = tokens(320, seed=0)
    tier.request(a, max_tokens=ANSWER)
    for seed, length in enumerate((320, 320, 64), start=10):
        tier.request(tokens(length, seed=seed))
    tier.reset_gpu()
    hit = tier.request([*a, *([SAMPLED_TOKEN] * ANSWER), *CONTINUATION])
    tier.invariants.check()
    return hit


def test_gpu_reuse_keeps_the_cpu_copy(plugin, adapter):
    """LRU evicts the conversation the GPU cache kept serving; the hybrid order keeps it."""
    assert _reuse_from_gpu(adapter, "lru") == (320, 0)
    assert _reuse_from_gpu(adapter, "hybrid") == (320, 320)


def test_intermediate_states_are_evicted_first(plugin, adapter):
    """LRU evicts A's oldest blocks (its hit drops to nothing); the hybrid order gives up the
    superseded chunk-end states first (A's, B's and C's below 320) and A's next turn hits 320."""
    assert _chunked_prompt(adapter, "lru") == 0
    assert _chunked_prompt(adapter, "hybrid") == 320


def test_superseded_answer_states_are_evicted_first(plugin, adapter):
    """LRU evicts A's oldest blocks; the hybrid order gives up the 6 answer states a later one of
    the same answer superseded, and A's next turn hits through the answer (432: the last unit
    boundary of the 439 computed tokens). 0.26-0.28 refuse the answer option at start-up."""
    if not adapter.output_checkpoint_supported:
        with pytest.raises(PluginConfigError, match=r"mamba_output_checkpoint: true needs vLLM >= 0\.29\.0"):
            _answer_states(adapter, "hybrid")
        return
    assert _answer_states(adapter, "lru") == 0
    assert _answer_states(adapter, "hybrid") == 432


def test_hybrid_tier_with_fine_grained_hits_off(plugin, adapter):
    """``fine_grained_hits: false`` runs the stock SimpleCPU scheduler up to 0.29 (no Mamba hand-offs
    consumed, hits on whole Mamba blocks): the option is refused there, naming lru. From 0.30 the
    wheel's own scheduler is the fine-grained one and the policy attaches."""
    def build():
        return SimEngine(
            HybridGeometry(),
            adapter=adapter,
            kv_connector=CONNECTOR_NAME,
            kv_connector_extra_config={
                "cpu_bytes_to_use": SMALL_TIER, "cpu_tier_eviction": "hybrid", "fine_grained_hits": False,
            },
        )

    if adapter.verdict(Feature.FINE_GRAINED_CPU_HITS).support is Support.NATIVE:
        assert build().connector.cpu_tier_policy is not None
        return
    with pytest.raises(PluginConfigError, match=REFUSED + r".*\(allowed here: lru\)"):
        build()


def test_hybrid_tier_refused_where_the_pool_cannot_be_read(plugin, adapter, mocker):
    """The order reads which copies an allocation evicts (adapter ``free_blocks_at_head``); a
    pool without a readable free queue (none among 0.26-0.33; here the adapter says so) refuses
    the option at start-up, naming lru, instead of running an order it cannot keep."""
    mocker.patch.object(type(adapter), "reads_next_free_block", return_value=False)
    with pytest.raises(PluginConfigError, match=r"cpu_tier_eviction: 'hybrid' reads the CPU pool's free queue.*\(allowed here: lru\)"):
        Tier(adapter, "hybrid")
    assert Tier(adapter, "lru").engine.connector.cpu_tier_policy is None


def test_bad_value_names_key_and_values(plugin, adapter):
    with pytest.raises(PluginConfigError, match=r"cpu_tier_eviction: .*allowed: lru or hybrid"):
        SimEngine(
            HybridGeometry(),
            adapter=adapter,
            kv_connector=CONNECTOR_NAME,
            kv_connector_extra_config={"cpu_bytes_to_use": SMALL_TIER, "cpu_tier_eviction": "lfu"},
        )


def test_lru_is_the_wheels_own_pool(plugin, adapter):
    """The default attaches nothing: the CPU pool's methods are the BlockPool class's own."""
    tier = Tier(adapter, "lru")
    connector = tier.engine.connector
    assert connector.cpu_tier_policy is None
    pool = tier.engine.offload_manager.cpu_block_pool
    assert "get_new_blocks" not in vars(pool) and "free_blocks" not in vars(pool)
    assert connector.offload_mode in (OffloadMode.NATIVE, OffloadMode.BACKPORT)


def _branches_at_chunk_ends(adapter, policy: str, keep_the_bet: bool = False) -> tuple[list[int], Any]:
    """A prefix tree the demotion bet loses on. Each round: A (336 tokens, prefilled in chunks of
    64: states at 64..256 superseded, so demoted) and two 64-token prompts that push blocks out of
    the tier; with the GPU cache reset, a request branches off A at 256, where A's chunk-end state
    sits. Returns each branch's hit and the policy (None under LRU)."""
    tier = Tier(adapter, policy, HybridGeometry(max_num_batched_tokens=64))
    order = tier.engine.connector.cpu_tier_policy
    if keep_the_bet:
        order.ghosts.min_demoted_evictions = 10**9  # never enough evidence: the order as first built
    hits, filler_seeds = [], itertools.count(1000)
    for round_ in range(8):
        a = tokens(336, seed=round_)
        tier.request(a)
        for _ in range(2):
            tier.request(tokens(64, seed=next(filler_seeds)))
        tier.reset_gpu()
        hits.append(tier.request([*a[:256], *tokens(48, seed=500 + round_)]))
    tier.invariants.check()
    return hits, order


def test_demotion_stops_while_it_costs_more_than_lru(plugin, adapter):
    """LRU keeps every branch point (256 each round); the demotion bet evicts A's chunk-end state
    in round 3 and from then on. A what-if lookup (the branch's lookup with the demoted keys the
    tier evicted counted as held) charges the 256 lost tokens to demotion; plain evictions cost
    none, so the order stops demoting and the later rounds hit 256 again."""
    assert _branches_at_chunk_ends(adapter, "lru")[0] == [256] * 8
    bet, order = _branches_at_chunk_ends(adapter, "hybrid", keep_the_bet=True)
    assert bet == [256, 256, 0, 0, 0, 0, 0, 0]
    assert (order.ghosts.totals["lost_demoted"], order.ghosts.totals["lost_plain"]) == (6 * 256, 0)
    learned, order = _branches_at_chunk_ends(adapter, "hybrid")
    assert learned == [256, 256, 0, 256, 256, 256, 256, 256]
    assert (order.ghosts.totals["lost_demoted"], order.ghosts.totals["lost_plain"]) == (256, 0)
    assert not order.ghosts.demotion_pays() and order.stats["demotion_withheld"] > 0


# Plain evictions of the 12 fillers that push A out of the 80-block tier (each wheel's chunking).
PUSHED_OUT = {"0.26.0": 75, "0.27.1": 75, "0.32.0": 69, "0.33.0": 69}


def test_a_cpu_cache_reset_is_no_eviction_loss(plugin, adapter):
    """A (336 tokens) is stored, then pushed out of the tier (62-75 plain evictions); the CPU cache is
    reset. A's next turn hits nothing, and no eviction class is charged for it: the reset would
    have dropped A's copies too (with the evicted keys kept across the reset, the what-if lookup
    charged 320 tokens to plain evictions and tilted the demotion verdict)."""
    tier = Tier(adapter, "hybrid")
    order = tier.engine.connector.cpu_tier_policy
    a = tokens(336, seed=1)
    assert tier.request(a) == 0
    for i in range(12):
        tier.request(tokens(160, seed=100 + i))
    pushed_out = PUSHED_OUT.get(adapter.version, 62)
    assert (len(order.ghosts), order.ghosts.totals["evicted_plain"]) == (pushed_out, pushed_out)
    tier.reset_gpu()
    assert tier.engine.connector.reset_cache() is True
    assert (len(order.ghosts), order.demoted) == (0, {})
    assert tier.request([*a, *tokens(20, seed=7)]) == 0
    assert (order.ghosts.totals["lost_plain"], order.ghosts.totals["lost_demoted"]) == (0, 0)
