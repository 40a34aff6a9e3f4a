"""A real NIXL transfer of the blocks the exchange clip and the worker pairing choose.

Two NIXL agents (UCX backend, CPU memory) stand for a prefill and a decode engine,
each with one KV pool of ``NUM_BLOCKS`` pages indexed by block id (the layout of a
hybrid model, whose groups share one pool). The decode agent READs exactly the
(decode, prefill) block pairs that the wheel's NIXL schedulers and worker produce;
afterwards each paired decode page must equal its prefill page byte for byte and
every other decode page must be untouched - in particular D's zeroed speculative
scratch slots, which stock 0.26 would overwrite or read.

The agents live in a child interpreter (``nixl_transfer_child.py``, which says why:
a native crash at interpreter exit on some hosts); this process computes the pairs
with vLLM's real schedulers and checks the bytes the child sends back.

Needs the ``nixl`` extra (``nixl==1.5.1`` + ``nixl-cu12==1.5.1``, installed
with ``--no-deps``; CI installs it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scenarios.nixl_pair import NUM_BLOCKS, NixlPair, decode_worker, has_mamba_cache_mode, worker_pairs

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


CHILD = Path(__file__).with_name("nixl_transfer_child.py")


@pytest.fixture(scope="module")
def nixl_api():
    """vLLM's own handles on the nixl library (None when the extra is not installed)."""
    from vllm.distributed import nixl_utils

    if nixl_utils.NixlWrapper is None or nixl_utils.nixl_agent_config is None:
        pytest.skip("the nixl extra is not installed (pip install 'hybrid-kv-plugin[nixl]')")
    return nixl_utils.NixlWrapper, nixl_utils.nixl_agent_config


def ucx_libraries_loaded() -> list[str]:
    """The UCX shared objects mapped into this process (none while only the child makes agents)."""
    with open("/proc/self/maps") as maps:
        return sorted({line.split()[-1] for line in maps if "libuc" in line or "UCX" in line})


def transfer_in_child(pairs: list[tuple[int, int]], notif: str) -> dict:
    """Run the READ of ``pairs`` in a fresh interpreter; its pools as (NUM_BLOCKS, PAGE_BYTES) tensors."""
    import torch

    request = {"pairs": pairs, "num_blocks": NUM_BLOCKS, "page_bytes": PAGE_BYTES, "notif": notif}
    child = subprocess.run(
        [sys.executable, str(CHILD)], input=json.dumps(request), capture_output=True, text=True, timeout=300
    )
    assert child.returncode == 0, f"NIXL child exited {child.returncode}:\n{child.stderr[-4000:]}"
    (line,) = [out for out in child.stdout.splitlines() if out.startswith("{")]
    result = json.loads(line)
    for key in ("before", "decode", "prefill"):
        raw = bytearray.fromhex(result[key])
        result[key] = torch.frombuffer(raw, dtype=torch.uint8).reshape(NUM_BLOCKS, PAGE_BYTES)
    return result


@pytest.mark.parametrize("case", list(TABLES))
def test_transfer_copies_exactly_the_paired_blocks(plugin, adapter, nixl_api, case):
    (mode, scratch), p_tables, d_tables, expected_pairs = TABLES[case]
    if not has_mamba_cache_mode(mode):  # 0.32+: nothing positional to copy
        return

    pair = NixlPair(adapter, "pull", mode, scratch)
    sent = pair.prefill_sends(list(p_tables))
    received = pair.decode_receives(list(d_tables))
    decode_ids, prefill_ids = worker_pairs(adapter, decode_worker(adapter, pair), received, sent)
    pairs = [(d, p) for dg, pg in zip(decode_ids, prefill_ids) for d, p in zip(dg, pg, strict=True)]
    assert pairs == expected_pairs

    result = transfer_in_child(pairs, notif="req-p:1")
    before, decode, prefill = result["before"], result["decode"], result["prefill"]
    assert result["state"] == "DONE"
    copied = {d for d, _ in pairs}
    for d, p in pairs:
        assert decode[d].equal(prefill[p]), f"decode block {d} != prefill block {p}"
    untouched = [i for i in range(NUM_BLOCKS) if i not in copied]
    assert len(untouched) == NUM_BLOCKS - len(pairs)
    assert decode[untouched].equal(before[untouched])
    # D's own scratch slots keep their bytes; P's scratch bytes land nowhere.
    assert decode[[71, 72]].equal(before[[71, 72]])
    for scratch_page in prefill[[41, 42]]:
        assert not (decode == scratch_page).all(dim=1).any()
    # The prefill side is told the read happened, the way vLLM frees P's blocks.
    assert result["notifs"] == ["req-p:1"]
    # The agents, and UCX with them, stayed in the child.
    assert ucx_libraries_loaded() == []
