"""``cpu_tier_request_ends: "skip"`` / ``"auto"``: the CPU tier declines request-end states off the
Mamba grid, always / from its first eviction on (offload/admission.py).

Real scheduler, KV-cache manager and ``HybridSimpleCPUConnector`` of the installed wheel
(0.26-0.29 run the plugin's backport, 0.30+ the wheel's own SimpleCPU scheduler: the same
numbers everywhere). Attention block 32, Mamba block 64, unit 16: a 344-token prompt ends at
the unit boundary 336, inside attention block 10 and off the Mamba grid, so its request-end
state is one Mamba state (336) and one attention partial tail (the block keyed at 336). Each
case measures every value of the option: what skipping costs, what it saves, and that ``auto``
pays the cost only once the tier is full.
"""

from __future__ import annotations

import random

import pytest

from hybrid_kv_plugin.adapters import Feature, Support
from hybrid_kv_plugin.config import PluginConfigError
from hybrid_kv_plugin.connector_names import CONNECTOR_NAME
from hybrid_kv_plugin.sim import HybridGeometry, SimEngine

from scenarios.offload import CONTINUATION, REQUEST_ENDS_TIER_BYTES as TIER_BYTES, RequestEndsTier

FA32 = HybridGeometry(attention_block_size=32)
REFUSED = (
    "invalid hybrid-kv-plugin configuration: kv_connector_extra_config.cpu_tier_request_ends: 'skip' "
    "needs the fine-grained hybrid SimpleCPU connector"
)


def tokens(n: int, seed: int) -> list[int]:
    """``n`` token ids (different seeds share no block)."""
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


Tier = RequestEndsTier


def _next_turn(adapter, ends: str, prompt_tokens: int) -> tuple[int, int, tuple[int, int] | None]:
    """A's prompt, the GPU cache reset, A's next turn (prompt + new text): (its hit, CPU blocks
    held before it, what was declined)."""
    tier = Tier(adapter, ends)
    a = tokens(prompt_tokens, seed=0)
    assert tier.request(a) == 0
    held = tier.held()
    tier.reset_gpu()
    return tier.request([*a, *CONTINUATION]), held, tier.declined()


@pytest.mark.both_schedulers
def test_next_turn_resumes_below_a_skipped_end(plugin, adapter):
    """The cost: A's end state at 336 (a Mamba state and the attention block keyed there) stays
    off the tier, so from the CPU tier alone A's next turn resumes at 320, the last Mamba block
    end, instead of 336. Both turns decline their own end (2 states, 2 partial tails). ``auto``
    stores them: the tier (13 of 79 blocks used) has never evicted."""
    assert _next_turn(adapter, "store", 344) == (336, 13, None)
    assert _next_turn(adapter, "skip", 344) == (320, 11, (2, 2))
    assert _next_turn(adapter, "auto", 344) == (336, 13, (0, 0))


@pytest.mark.both_schedulers
def test_an_end_on_the_mamba_grid_is_stored(plugin, adapter):
    """A 321-token prompt ends at the unit boundary 320, a Mamba block end and an attention
    block end: nothing to decline, the next turn resumes at 320 either way."""
    assert _next_turn(adapter, "store", 321) == (320, 10 + 1, None)
    assert _next_turn(adapter, "skip", 321) == (320, 10 + 1, (0, 0))


def _shared_prefix_after(adapter, ends: str, requests: int) -> tuple[int, int, tuple[int, int] | None]:
    """``requests`` prompts share S (320 tokens) and end in 24 tokens of their own: each one's end
    state (336) is new, S is on the tier after the first. With the GPU cache reset, a last prompt
    on S: (its hit, CPU blocks held before it, what was declined)."""
    tier = Tier(adapter, ends)
    shared = tokens(320, seed=0)
    hits = [tier.request([*shared, *tokens(24, seed=100 + k)]) for k in range(requests)]
    assert hits == [0] + [320] * (requests - 1)  # from the GPU cache
    held = tier.held()
    tier.reset_gpu()
    return tier.request([*shared, *tokens(24, seed=999)]), held, tier.declined()


@pytest.mark.both_schedulers
def test_request_ends_push_out_a_shared_prefix(plugin, adapter):
    """The saving: stored, 40 request ends (2 blocks each) fill the 79-block tier and LRU evicts S,
    which every request reused from the GPU cache; the last prompt on S gets nothing from the tier.
    Skipped, the tier holds S (10 attention blocks and the state at 320) and it resumes at 320.
    ``auto`` stores the first 34 ends (11 + 34 * 2 = 79 blocks: the tier is full without evicting
    anything) and declines the other 7 with their partial tails: S stays, 320 from a full tier."""
    assert _shared_prefix_after(adapter, "store", 40) == (0, 79, None)
    assert _shared_prefix_after(adapter, "skip", 40) == (320, 11, (41, 41))
    assert _shared_prefix_after(adapter, "auto", 40) == (320, 79, (7, 7))


# Filler prompt lengths, tried in order: the first that leaves 12 never-used blocks on the tier is the
# case (each wheel's store accounting differs by a block or two for the same filler).
FILLERS = range(2084, 2124, 2)


def _end_state_stored_as_the_tier_fills(adapter) -> tuple[int, tuple[int, int] | None, int]:
    """``auto``: a filler leaves 12 never-used blocks, then A (344 tokens): its last prefill step
    takes A's end state (a never-used block is next) and that step's stores evict for the first
    time, so A finishes on a full tier. (the filler used, what A's request declined, A's next
    turn's hit from the CPU tier)."""
    for filler in FILLERS:
        tier = Tier(adapter, "auto")
        tier.request(tokens(filler, seed=50))
        if tier.held() == 79 - 12:
            break
    else:
        raise AssertionError(f"no filler in {FILLERS} leaves 12 never-used blocks")
    a = tokens(344, seed=0)
    tier.request(a)
    declined = tier.declined()
    tier.reset_gpu()
    return filler, declined, tier.request([*a, *CONTINUATION])


@pytest.mark.both_schedulers
def test_a_stored_end_state_keeps_its_partial_tail(plugin, adapter):
    """A's end state (336) was stored while the tier had room; A finishes after the tier filled,
    when ``auto`` declines request ends. Its attention partial tail (the block keyed at 336) is
    still stored, since the tier holds the state it leads to: nothing declined, and A's next turn
    resumes at 336 from the CPU tier. Declining it (the rule before) left the state on the tier
    with no attention reaching it: declined (0 states, 1 partial tail), the next turn at 320."""
    filler, declined, hit = _end_state_stored_as_the_tier_fills(adapter)
    assert (declined, hit) == ((0, 0), 336), filler


DIVERGENCE = {"hybrid_kv": {"mamba_divergence_checkpoint": True}}


def _branch_at_the_end(adapter, ends: str) -> tuple[int, int, int, tuple[int, int] | None]:
    """With ``mamba_divergence_checkpoint``: A (400 tokens, its end on the Mamba grid at 384), then
    B and C, each A's first 336 tokens and 8 of their own. B's divergence point (336) is also its prompt's end; with the GPU
    cache reset, C resumes from the CPU tier: (B's divergence point, B's hit, C's hit, declined)."""
    tier = Tier(adapter, ends, additional_config=DIVERGENCE)
    a = tokens(400, seed=0)
    tier.request(a)
    b = tier.engine.add_request("b", [*a[:336], *tokens(8, seed=1)], max_tokens=1)
    tier.engine.run_until_idle()
    tier.invariants.check()
    tier.reset_gpu()
    c = tier.request([*a[:336], *tokens(8, seed=2)])
    return b.shared_prefix_boundary, tier.engine.outcomes["b"].hit_tokens, c, tier.declined()


def test_a_divergence_point_at_the_prompt_end_is_stored(plugin, adapter):
    """B's state at 336 is where B diverged from A (B recomputes from 0: A kept no state below
    384), so other requests share it: it is stored although it is B's end too, and C resumes at
    336 from the CPU tier. Declined: A's partial tail (keyed at 400, off the grid) and C's own
    end state (336 again, already on the tier). 0.26-0.28 refuse the divergence option."""
    if not adapter.divergence_checkpoint_supported:
        with pytest.raises(PluginConfigError, match=r"mamba_divergence_checkpoint: true needs vLLM >= "):
            Tier(adapter, "skip", additional_config=DIVERGENCE)
        return
    assert _branch_at_the_end(adapter, "store") == (336, 0, 336, None)
    assert _branch_at_the_end(adapter, "skip") == (336, 0, 336, (1, 1))
    assert _branch_at_the_end(adapter, "auto") == (336, 0, 336, (0, 0))


def test_skip_with_fine_grained_hits_off(plugin, adapter):
    """``fine_grained_hits: false`` runs the stock SimpleCPU scheduler up to 0.29 (it consumes no
    Mamba hand-offs): ``skip`` is refused there, naming store; ``auto`` attaches nothing. From
    0.30 the wheel's own scheduler is the fine-grained one and the admission attaches."""
    if adapter.verdict(Feature.FINE_GRAINED_CPU_HITS).support is Support.NATIVE:
        assert Tier(adapter, "skip", fine_grained_hits=False).declined() == (0, 0)
        assert Tier(adapter, "auto", fine_grained_hits=False).declined() == (0, 0)
        return
    with pytest.raises(PluginConfigError, match=REFUSED + r".*\(allowed here: store\)"):
        Tier(adapter, "skip", fine_grained_hits=False)
    assert Tier(adapter, "auto", fine_grained_hits=False).declined() is None


def test_auto_is_the_default(plugin, adapter):
    """Without the key the admission runs ``auto``; with ``fine_grained_hits: false`` up to 0.29
    (the stock SimpleCPU scheduler) it attaches nothing."""
    engine = SimEngine(
        FA32, adapter=adapter, kv_connector=CONNECTOR_NAME, kv_connector_extra_config={"cpu_bytes_to_use": TIER_BYTES}
    )
    admission = engine.connector.request_end_admission
    assert (admission.only_when_full, admission.takes_request_ends()) == (True, True)
    coarse = SimEngine(
        FA32,
        adapter=adapter,
        kv_connector=CONNECTOR_NAME,
        kv_connector_extra_config={"cpu_bytes_to_use": TIER_BYTES, "fine_grained_hits": False},
    )
    native = adapter.verdict(Feature.FINE_GRAINED_CPU_HITS).support is Support.NATIVE
    assert (coarse.connector.request_end_admission is not None) is native


def test_bad_value_names_key_and_values(plugin, adapter):
    with pytest.raises(PluginConfigError, match=r"cpu_tier_request_ends: .*allowed: auto, store or skip"):
        Tier(adapter, "drop")


def test_store_is_the_wheels_own_scheduler(plugin, adapter):
    """The default attaches nothing: the partial-tail finder is the scheduler class's own."""
    tier = Tier(adapter, "store")
    manager = tier.engine.connector.scheduler_manager
    assert tier.declined() is None
    assert adapter.simplecpu_partial_tail_finder not in vars(manager)
    assert callable(getattr(type(manager), adapter.simplecpu_partial_tail_finder))

