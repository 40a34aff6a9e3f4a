"""Seed 004: NIXL P/D exchange clip and Mamba state-slot pairing, with the wheel's real NIXL classes.

Every wheel must produce the same lists: 0.26 through the plugin's backport,
0.27+ natively (the plugin patches nothing there). Hand-made block tables,
three groups: full attention (FA), sliding window of 32 tokens at 16-token
blocks (the scheduler keeps 3 tail blocks) and Mamba.
"""

from __future__ import annotations

import inspect

import pytest

import hybrid_kv_plugin
from hybrid_kv_plugin import registration
from hybrid_kv_plugin.adapters import Feature, Support
from hybrid_kv_plugin.nixl import ExchangeClip, GroupRule, SsmSlotPairingError, pair_ssm_slots
from hybrid_kv_plugin.patches import patch_specs

from scenarios.nixl_pair import NixlPair, decode_worker, has_mamba_cache_mode, worker_pairs

N = None  # the pool's null block in a decode-side table

P_FA, P_SW = [1, 2, 3, 4], [0, 0, 5, 6, 7, 8]
D_FA, D_SW = [11, 12, 13, 14], [15, 16, 17, 18, 19]
SW_TAIL_P, SW_TAIL_D = [6, 7, 8], [17, 18, 19]

# (mamba cache mode, scratch slots) -> Mamba table of P, of D; exchanged by P, by D; paired (D, P).
CASES = {
    "single-state, 2 scratch": (
        ("align", 2),
        [0, 0, 0, 40, 41, 42],
        [N, N, N, 70, 71, 72],
        [40],
        [70],
        ([70], [40]),
    ),
    "single-state, no spec": (("align", 0), [0, 0, 0, 40], [N, N, N, 70], [40], [70], ([70], [40])),
    "no prefix caching, 2 scratch": (("none", 2), [40, 41, 42], [70, 71, 72], [40], [70], ([70], [40])),
    "positional, 2 scratch": (
        ("all", 2),
        [36, 37, 38, 40, 41, 42],
        [66, 67, 68, 69, 70, 71, 72],
        [36, 37, 38, 40],
        [66, 67, 68, 69, 70],
        ([66, 67, 68, 69], [36, 37, 38, 40]),
    ),
    "positional, no spec": (
        ("all", 0),
        [36, 37, 38, 40],
        [66, 67, 68, 69, 70],
        [36, 37, 38, 40],
        [66, 67, 68, 69, 70],
        ([66, 67, 68, 69], [36, 37, 38, 40]),
    ),
}
UNPAIRABLE = r"Group 2: unpairable SSM state slots, (local|decode)=3 (remote|prefill)=1"


def _support(adapter) -> Support:
    return adapter.verdict(Feature.NIXL_SSM_SLOT_PAIRING).support


# ---------------------------------------------------------------------- the real schedulers, every wheel


@pytest.mark.parametrize("kind", ["pull", "push"])
@pytest.mark.parametrize("case", list(CASES))
def test_exchange_lists_and_pairing(plugin, adapter, kind, case):
    (mode, scratch), p_mamba, d_mamba, p_sent, d_recv, paired = CASES[case]
    if not has_mamba_cache_mode(mode):  # 0.32+ have no 'all': nothing positional to pair
        return
    pair = NixlPair(adapter, kind, mode, scratch)

    sent = pair.prefill_sends([P_FA, P_SW, p_mamba])
    received = pair.decode_receives([D_FA, D_SW, d_mamba])

    assert sent == [P_FA, SW_TAIL_P, p_sent]
    assert received == [D_FA, SW_TAIL_D, d_recv]
    decode, prefill = worker_pairs(adapter, decode_worker(adapter, pair), received, sent)
    assert (decode, prefill) == ([D_FA, SW_TAIL_D, paired[0]], [P_FA, SW_TAIL_P, paired[1]])


@pytest.mark.parametrize("kind", ["pull", "push"])
def test_host_buffer_save_path_keeps_mamba_ids_whole(plugin, adapter, kind):
    """One step's added ids are not a whole table: only the sliding window is trimmed there."""
    pair = NixlPair(adapter, kind, "align", 2)
    assert pair.prefill_saves([[1, 2], [3, 4, 5, 6], [40, 41, 42]]) == [[1, 2], [4, 5, 6], [40, 41, 42]]


def test_worker_pairs_positional_slots_or_refuses(plugin, adapter):
    if not has_mamba_cache_mode("all"):
        return
    pair = NixlPair(adapter, "pull", "all", 2)
    worker = decode_worker(adapter, pair)
    fa = [[11, 12], [17, 18, 19]], [[1, 2], [6, 7, 8]]

    # D has the first positions from its own prefix cache: it pairs with P's tail.
    assert worker_pairs(adapter, worker, [*fa[0], [69, 70]], [*fa[1], [36, 37, 38, 40]]) == (
        [*fa[0], [69, 70]],
        [*fa[1], [38, 40]],
    )
    # D's one extra slot is the position it recomputes: it gets nothing.
    assert worker_pairs(adapter, worker, [*fa[0], [67, 68, 69, 70]], [*fa[1], [37, 38, 40]]) == (
        [*fa[0], [67, 68, 69]],
        [*fa[1], [37, 38, 40]],
    )
    with pytest.raises(AssertionError, match=UNPAIRABLE):
        worker_pairs(adapter, worker, [*fa[0], [68, 69, 70]], [*fa[1], [40]])


def test_worker_refuses_unpairable_single_state_lists(plugin, adapter):
    pair = NixlPair(adapter, "pull", "align", 2)
    worker = decode_worker(adapter, pair)
    with pytest.raises(AssertionError, match=UNPAIRABLE):
        worker_pairs(adapter, worker, [[11], [17], [68, 69, 70]], [[1], [6], [40]])


def test_decode_cannot_trust_an_unclipped_prefill(plugin, adapter):
    """A prefill instance on stock 0.26 without the plugin sends its whole Mamba table.

    The backport refuses it; a native decode (0.27+) trusts its peer's clip and reads
    the list's last slot - P's scratch slot 42 - which is why both instances must
    run the plugin (or both be on 0.27+).
    """
    pair = NixlPair(adapter, "pull", "align", 2)
    worker = decode_worker(adapter, pair)
    decode, prefill = [[11], [17], [70]], [[1], [6], [0, 0, 0, 40, 41, 42]]
    if _support(adapter) is Support.BACKPORT:
        with pytest.raises(SsmSlotPairingError, match="prefill list was not clipped.*both the prefill and the decode"):
            worker_pairs(adapter, worker, decode, prefill)
    else:
        assert worker_pairs(adapter, worker, decode, prefill) == (decode, [[1], [6], [42]])


def test_stock_026_crash_is_what_the_plugin_changes(no_plugin, adapter):
    """Stock 0.26: P ships its whole Mamba table and the D worker asserts; registering fixes it."""

    def transfer() -> tuple[list[list[int]], list[list[int]], object]:
        pair = NixlPair(adapter, "pull", "align", 2)
        sent = pair.prefill_sends([P_FA, P_SW, [0, 0, 0, 40, 41, 42]])
        received = pair.decode_receives([D_FA, D_SW, [N, N, N, 70, 71, 72]])
        return sent, received, decode_worker(adapter, pair)

    sent, received, worker = transfer()
    if _support(adapter) is Support.BACKPORT:
        assert (sent[2], received[2]) == ([0, 0, 0, 40, 41, 42], [70, 71, 72])
        with pytest.raises(AssertionError, match="SSM can only have one local block"):
            worker_pairs(adapter, worker, received, sent)
    else:
        assert (sent[2], received[2]) == ([40], [70])

    hybrid_kv_plugin.register()
    assert registration.STATE.status == "active"
    sent, received, worker = transfer()
    assert (sent[2], received[2]) == ([40], [70])
    assert worker_pairs(adapter, worker, received, sent) == ([D_FA, SW_TAIL_D, [70]], [P_FA, SW_TAIL_P, [40]])


# ---------------------------------------------------------------------- adapter wiring


NIXL_PATCHES = ["nixl_exchange_clip", "nixl_save_meta", "nixl_worker_pairing"]


def test_backport_installed_only_where_native_is_missing(adapter):
    names = [spec.name for spec in patch_specs(adapter)]
    installed = [name for name in names if name.startswith("nixl_")]
    if _support(adapter) is Support.BACKPORT:
        assert installed == NIXL_PATCHES
        assert adapter.verdict(Feature.NIXL_SSM_SLOT_PAIRING).reason == (
            "the NIXL scheduler clips sliding-window groups only"
        )
    else:
        assert _support(adapter) is Support.NATIVE
        assert installed == []
        assert adapter.installs_backport(Feature.NIXL_SSM_SLOT_PAIRING) is False


def test_changed_nixl_worker_leaves_vllm_stock(no_plugin, adapter, monkeypatch):
    """The 0.28+ signature on a 0.26 wheel: nothing is patched (native wheels never look)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlBaseConnectorScheduler, NixlBaseConnectorWorker

    def renamed(self, decode_block_ids, prefill_block_ids, decode_ppl, prefill_ppl):
        raise AssertionError("never called")

    monkeypatch.setattr(NixlBaseConnectorWorker, "_apply_prefix_caching", renamed)
    clip_before = inspect.getattr_static(NixlBaseConnectorScheduler, "get_sw_clipped_blocks", None)
    hybrid_kv_plugin.register()

    if _support(adapter) is Support.BACKPORT:
        assert registration.STATE.status == "mismatch"
        assert "NixlBaseConnectorWorker._apply_prefix_caching" in registration.STATE.reason
        assert inspect.getattr_static(NixlBaseConnectorScheduler, "get_sw_clipped_blocks") is clip_before
    else:
        assert registration.STATE.status == "active"
    assert inspect.getattr_static(NixlBaseConnectorWorker, "_apply_prefix_caching") is renamed


# ---------------------------------------------------------------------- the plugin's own rules (no vLLM state)


@pytest.mark.parametrize(
    ("rule", "blocks", "kept"),
    [
        (GroupRule(scratch_slots=2), [0, 0, 0, 40, 41, 42], [40]),
        (GroupRule(scratch_slots=2), [40, 41], [40]),  # scratch not yet allocated in full
        (GroupRule(scratch_slots=2), [40], [40]),  # never empty: that reads as a full hit
        (GroupRule(scratch_slots=0), [0, 0, 40], [40]),
        (GroupRule(scratch_slots=2, positional=True), [36, 37, 40, 41, 42], [36, 37, 40]),
        (GroupRule(scratch_slots=2, positional=True), [], []),
        (GroupRule(window_blocks=3), [0, 0, 5, 6, 7, 8], [6, 7, 8]),
        (GroupRule(), [1, 2, 3], [1, 2, 3]),
    ],
)
def test_group_rule_clip(rule, blocks, kept):
    assert rule.clip(blocks) == kept


def test_partial_lists_keep_mamba_slots():
    clip = ExchangeClip((GroupRule(), GroupRule(window_blocks=3), GroupRule(scratch_slots=2)))
    table = ([1, 2], [3, 4, 5, 6], [40, 41, 42])
    assert clip.apply(table) == ([1, 2], [4, 5, 6], [40])
    assert clip.apply(table, strip_ssm=False) == ([1, 2], [4, 5, 6], [40, 41, 42])
    with pytest.raises(ValueError, match="2 block lists for 3 KV-cache groups"):
        clip.apply(table[:2])


@pytest.mark.parametrize(
    ("decode", "prefill", "positional", "paired"),
    [
        ([70], [40], False, ([70], [40])),
        ([], [40], False, ([], [])),  # nothing to receive into: nothing is read
        ([69, 70], [36, 37, 38, 40], True, ([69, 70], [38, 40])),
        ([67, 68, 69, 70], [37, 38, 40], True, ([67, 68, 69], [37, 38, 40])),
        ([], [37, 38, 40], True, ([], [])),
    ],
)
def test_pair_ssm_slots(decode, prefill, positional, paired):
    assert pair_ssm_slots(2, decode, prefill, positional=positional) == paired


@pytest.mark.parametrize(
    ("decode", "prefill", "positional", "message"),
    [
        ([68, 69, 70], [40], True, "decode=3 prefill=1: decode may hold at most one slot more"),
        ([70], [40, 41, 42], False, "decode=1 prefill=3: .* the prefill list was not clipped"),
        ([69, 70], [40], False, "decode=2 prefill=1: .* the decode list was not clipped"),
    ],
)
def test_pair_ssm_slots_refuses(decode, prefill, positional, message):
    with pytest.raises(SsmSlotPairingError, match=message):
        pair_ssm_slots(2, decode, prefill, positional=positional)
