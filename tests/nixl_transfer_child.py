"""Child process of ``test_nixl_transfer.py``: two real NIXL agents, one READ, the pools back as JSON.

Why a child: on some hosts (an Intel Xeon with AMX, UCX 1.x inside ``nixl-cu12==1.5.1``) the pytest
interpreter that had created NIXL agents passed every test and then died with SIGSEGV after Python's
own shutdown, in native teardown (no Python traceback with ``PYTHONFAULTHANDLER=1``). The agents are
torn down here in order (handles, remote agent, memory, agent, then a collection), the results are
written and flushed, and the process leaves with ``os._exit(0)``, which skips the UCX library
destructors that run after interpreter shutdown. The pytest process itself never loads UCX (its
test asserts that), so its exit is the interpreter's own.

stdin: ``{"pairs": [[decode, prefill], ...], "num_blocks": N, "page_bytes": B, "notif": "..."}``;
stdout: one JSON line ``{"before": hex, "decode": hex, "prefill": hex, "state": str, "notifs": [...]}``
(each pool as ``num_blocks * page_bytes`` bytes, row-major). Failures exit non-zero with a traceback.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import uuid


class _Side:
    """One side's KV pool registered with its own NIXL agent, one descriptor per block id."""

    def __init__(self, wrapper_cls, config_cls, role: str, seed: int, num_blocks: int, page_bytes: int):
        import torch

        self.agent = wrapper_cls(f"{role}-{uuid.uuid4()}", config_cls(backends=["UCX"]))
        self.name = self.agent.name
        generator = torch.Generator().manual_seed(seed)
        self.pool = torch.randint(0, 256, (num_blocks, page_bytes), dtype=torch.uint8, generator=generator)
        base = self.pool.data_ptr()
        self.registration = self.agent.register_memory([(base, self.pool.numel(), 0, "")], "DRAM")
        self.blocks = [(base + i * page_bytes, page_bytes, 0) for i in range(num_blocks)]

    def close(self) -> None:
        self.agent.deregister_memory(self.registration)
        self.registration = None
        self.agent = None


def _read(decode: _Side, prefill: _Side, pairs: list[tuple[int, int]], notif: bytes) -> tuple[str, list[bytes]]:
    """Decode READs prefill page p into its page d for every (d, p) pair; the state and P's notifications."""
    remote_name = decode.agent.add_remote_agent(prefill.agent.get_agent_metadata())
    local = decode.agent.prep_xfer_dlist("NIXL_INIT_AGENT", decode.blocks, "DRAM")
    remote = decode.agent.prep_xfer_dlist(remote_name, prefill.blocks, "DRAM")
    handle = decode.agent.make_prepped_xfer("READ", local, [d for d, _ in pairs], remote, [p for _, p in pairs], notif)
    try:
        state = decode.agent.transfer(handle)
        deadline = time.monotonic() + 30
        while state not in ("DONE", "ERR") and time.monotonic() < deadline:
            state = decode.agent.check_xfer_state(handle)
        # The prefill side is told the read happened, the way vLLM frees P's blocks.
        notifs: list[bytes] = []
        deadline = time.monotonic() + 10
        while state == "DONE" and not notifs and time.monotonic() < deadline:
            notifs = prefill.agent.get_new_notifs().get(decode.name, [])
        return state, notifs
    finally:
        decode.agent.release_xfer_handle(handle)
        decode.agent.release_dlist_handle(local)
        decode.agent.release_dlist_handle(remote)
        decode.agent.remove_remote_agent(remote_name)


def main() -> None:
    from vllm.distributed import nixl_utils

    request = json.loads(sys.stdin.read())
    pairs = [tuple(pair) for pair in request["pairs"]]
    shape = (request["num_blocks"], request["page_bytes"])
    api = (nixl_utils.NixlWrapper, nixl_utils.nixl_agent_config)
    prefill, decode = _Side(*api, "prefill", 1, *shape), _Side(*api, "decode", 2, *shape)
    try:
        before = decode.pool.clone()
        state, notifs = _read(decode, prefill, pairs, request["notif"].encode())
    finally:
        decode.close()
        prefill.close()
    gc.collect()  # the agents (and their progress threads) end here, before any interpreter teardown
    result = {
        "before": before.numpy().tobytes().hex(),
        "decode": decode.pool.numpy().tobytes().hex(),
        "prefill": prefill.pool.numpy().tobytes().hex(),
        "state": state,
        "notifs": [n.decode() for n in notifs],
    }
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
    os._exit(0)
