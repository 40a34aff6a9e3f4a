"""A real NIXL transfer of the blocks the exchange clip and the worker pairing choose.

Two NIXL agents in this process (UCX backend, CPU memory) stand for a prefill
and a decode engine, each with one KV pool of ``NUM_BLOCKS`` pages indexed by
block id (the layout of a hybrid model, whose groups share one pool). The
decode agent READs exactly the (decode, prefill) block pairs that the wheel's
NIXL schedulers and worker produce; afterwards each paired decode page must
equal its prefill page byte for byte and every other decode page must be
untouched - in particular D's zeroed speculative scratch slots, which stock
0.26 would overwrite or read.

Needs the ``nixl`` extra (``nixl==1.5.1`` + ``nixl-cu12==1.5.1``, installed
with ``--no-deps``; CI installs it).
"""

from __future__ import annotations

import time
import uuid

import pytest

from hybrid_kv_plugin.sim.nixl_pair import NUM_BLOCKS, NixlPair, decode_worker, mamba_cache_modes, worker_pairs

N = None
PAGE_BYTES = 256
TABLES = {
    # (mode, scratch): (P tables, D tables, the (decode, prefill) pages a correct transfer copies)
    "single-state, 2 scratch": (
        ("align", 2),
        ([1, 2, 3, 4], [0, 0, 5, 6, 7, 8], [0, 0, 0, 40, 41, 42]),
        ([11, 12, 13, 14], [15, 16, 17, 18, 19], [N, N, N, 70, 71, 72]),
        [(11, 1), (12, 2), (13, 3), (14, 4), (17, 6), (18, 7), (19, 8), (70, 40)],
    ),
    "positional, 2 scratch": (
        ("all", 2),
        ([1, 2, 3, 4], [0, 0, 5, 6, 7, 8], [36, 37, 38, 40, 41, 42]),
        ([11, 12, 13, 14], [15, 16, 17, 18, 19], [66, 67, 68, 69, 70, 71, 72]),
        [(11, 1), (12, 2), (13, 3), (14, 4), (17, 6), (18, 7), (19, 8), (66, 36), (67, 37), (68, 38), (69, 40)],
    ),
}


@pytest.fixture(scope="module")
def nixl_api():
    """vLLM's own handles on the nixl library (None when the extra is not installed)."""
    from vllm.distributed import nixl_utils

    if nixl_utils.NixlWrapper is None or nixl_utils.nixl_agent_config is None:
        pytest.skip("the nixl extra is not installed (pip install 'hybrid-kv-plugin[nixl]')")
    return nixl_utils.NixlWrapper, nixl_utils.nixl_agent_config


class _Engine:
    """One side's KV pool registered with its own NIXL agent, one descriptor per block id."""

    def __init__(self, api, role: str, seed: int):
        import torch

        wrapper_cls, config_cls = api
        self.agent = wrapper_cls(f"{role}-{uuid.uuid4()}", config_cls(backends=["UCX"]))
        self.name = self.agent.name
        generator = torch.Generator().manual_seed(seed)
        self.pool = torch.randint(0, 256, (NUM_BLOCKS, PAGE_BYTES), dtype=torch.uint8, generator=generator)
        base = self.pool.data_ptr()
        self.registration = self.agent.register_memory([(base, self.pool.numel(), 0, "")], "DRAM")
        self.blocks = [(base + i * PAGE_BYTES, PAGE_BYTES, 0) for i in range(NUM_BLOCKS)]

    def close(self) -> None:
        self.agent.deregister_memory(self.registration)


def _read(decode: _Engine, prefill: _Engine, pairs: list[tuple[int, int]], notif: bytes) -> None:
    """Decode READs prefill page p into its page d for every (d, p) pair, and waits for completion."""
    remote_name = decode.agent.add_remote_agent(prefill.agent.get_agent_metadata())
    local = decode.agent.prep_xfer_dlist("NIXL_INIT_AGENT", decode.blocks, "DRAM")
    remote = decode.agent.prep_xfer_dlist(remote_name, prefill.blocks, "DRAM")
    handle = decode.agent.make_prepped_xfer(
        "READ", local, [d for d, _ in pairs], remote, [p for _, p in pairs], notif
    )
    try:
        state = decode.agent.transfer(handle)
        deadline = time.monotonic() + 30
        while state not in ("DONE", "ERR") and time.monotonic() < deadline:
            state = decode.agent.check_xfer_state(handle)
        assert state == "DONE", state
    finally:
        decode.agent.release_xfer_handle(handle)
        decode.agent.release_dlist_handle(local)
        decode.agent.release_dlist_handle(remote)
        decode.agent.remove_remote_agent(remote_name)


@pytest.mark.parametrize("case", list(TABLES))
def test_transfer_copies_exactly_the_paired_blocks(plugin, adapter, nixl_api, case):
    (mode, scratch), p_tables, d_tables, expected_pairs = TABLES[case]
    if mode not in mamba_cache_modes():
        pytest.skip(f"this vLLM has no Mamba cache mode {mode!r} (removed in 0.32): nothing positional to copy")

    pair = NixlPair(adapter, "pull", mode, scratch)
    sent = pair.prefill_sends(list(p_tables))
    received = pair.decode_receives(list(d_tables))
    decode_ids, prefill_ids = worker_pairs(adapter, decode_worker(adapter, pair), received, sent)
    pairs = [(d, p) for dg, pg in zip(decode_ids, prefill_ids) for d, p in zip(dg, pg, strict=True)]
    assert pairs == expected_pairs

    prefill, decode = _Engine(nixl_api, "prefill", seed=1), _Engine(nixl_api, "decode", seed=2)
    try:
        before = decode.pool.clone()
        _read(decode, prefill, pairs, notif=b"req-p:1")

        copied = {d for d, _ in pairs}
        for d, p in pairs:
            assert decode.pool[d].equal(prefill.pool[p]), f"decode block {d} != prefill block {p}"
        untouched = [i for i in range(NUM_BLOCKS) if i not in copied]
        assert len(untouched) == NUM_BLOCKS - len(pairs)
        assert decode.pool[untouched].equal(before[untouched])
        # D's own scratch slots keep their bytes; P's scratch bytes land nowhere.
        assert decode.pool[[71, 72]].equal(before[[71, 72]])
        for scratch_page in prefill.pool[[41, 42]]:
            assert not (decode.pool == scratch_page).all(dim=1).any()
        # The prefill side is told the read happened, the way vLLM frees P's blocks.
        deadline = time.monotonic() + 10
        notifs: list[bytes] = []
        while not notifs and time.monotonic() < deadline:
            notifs = prefill.agent.get_new_notifs().get(decode.name, [])
        assert notifs == [b"req-p:1"]
    finally:
        decode.close()
        prefill.close()
