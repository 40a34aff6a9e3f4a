"""Which vLLM process this is, and which sides of vLLM it runs.

vLLM names the processes it starts (``multiprocessing`` process names, the same
from 0.26 to 0.33): ``ApiServer_<i>`` (extra API servers, ``--api-server-count``),
``EngineCore`` / ``EngineCore_DP<i>`` (the scheduler; with a single-process
executor its worker lives here too) and ``VllmWorker-<rank>`` (multiprocess
executor workers). Any other name - ``MainProcess`` of ``vllm serve`` or of an
in-process ``LLM`` engine, a test, a custom launcher - may host everything.

Invariant: a process is given a side only when its name proves it does not run
the other one; an unknown name gets every side.
"""

from __future__ import annotations

import multiprocessing
from enum import Enum


class Side(str, Enum):
    """Where a patched vLLM attribute runs."""

    SCHEDULER = "scheduler"  # the engine core: Scheduler, KV cache manager, connector scheduler side
    WORKER = "worker"  # the model runner's process: connector worker side
    FRONTEND = "frontend"  # the in-process LLM engine (LLMEngine); an API server runs AsyncLLM instead


class Role(str, Enum):
    API_SERVER = "api_server"
    ENGINE_CORE = "engine_core"
    WORKER = "worker"
    ANY = "any"  # not a process vLLM named: may run every side

    @property
    def sides(self) -> frozenset[Side]:
        return _SIDES[self]


_SIDES = {
    Role.API_SERVER: frozenset(),
    Role.ENGINE_CORE: frozenset({Side.SCHEDULER, Side.WORKER}),  # a single-process executor's worker
    Role.WORKER: frozenset({Side.WORKER}),
    Role.ANY: frozenset({Side.SCHEDULER, Side.WORKER, Side.FRONTEND}),
}
_PREFIXES = (("ApiServer_", Role.API_SERVER), ("EngineCore", Role.ENGINE_CORE), ("VllmWorker-", Role.WORKER))


def role_of(process_name: str) -> Role:
    for prefix, role in _PREFIXES:
        if process_name.startswith(prefix):
            return role
    return Role.ANY


def current_role() -> Role:
    return role_of(multiprocessing.current_process().name)
