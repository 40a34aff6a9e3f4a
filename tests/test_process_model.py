"""``register()`` under vLLM's multi-process start: one registration per process, every patch in each.

vLLM starts the API server, the engine core and each worker as separate processes
(the ``spawn`` start method wherever CUDA may be initialised) and every one of them
calls ``vllm.plugins.load_general_plugins()`` - from ``EngineArgs.__post_init__``,
the start of ``EngineCore.__init__`` and ``WorkerWrapperBase.init_worker`` - which
runs each ``vllm.general_plugins`` entry point once per process. This test spawns
one process per role the same way and asks each what the plugin did there.

Documented behaviour asserted exactly: in every process the plugin registers once
(a second loader call changes nothing), installs *all* of the wheel's patches -
also those only one role uses, e.g. the NIXL worker pairing in the API server - and
registers the connector name.
"""

from __future__ import annotations

import inspect
import multiprocessing
import os

ROLES = ("api_server", "engine_core", "worker")


def _resolve(target: str):
    import importlib

    module, _, path = target.partition(":")
    owner = importlib.import_module(module)
    *parents, attr = path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    return inspect.getattr_static(owner, attr)


def _role_main(role: str, queue) -> None:
    """What one vLLM process does at start-up, then a report of the plugin's state there."""
    try:
        import vllm.plugins

        # vLLM reaches the loader from several places in one process; its guard runs plugins once.
        vllm.plugins.load_general_plugins()
        vllm.plugins.load_general_plugins()
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        from hybrid_kv_plugin import CONNECTOR_NAME, registration
        from hybrid_kv_plugin.patching import is_patched

        state = registration.STATE
        specs = state.patch_set.specs if state.patch_set is not None else ()
        queue.put(
            {
                "role": role,
                "pid": os.getpid(),
                "status": state.status,
                "calls": state.calls,
                "installs": state.installs,
                "patched": sorted(s.name for s in specs if is_patched(_resolve(s.target))),
                "connector": CONNECTOR_NAME in KVConnectorFactory._registry,
            }
        )
    except BaseException as exc:  # report instead of hanging the parent
        queue.put({"role": role, "error": repr(exc)})


def test_each_spawned_process_registers_once_with_every_patch(adapter, monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv("HYBRID_KV_PLUGIN_DISABLE", raising=False)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=_role_main, args=(role, queue), name=role) for role in ROLES]
    for process in processes:
        process.start()
    reports = {}
    for _ in ROLES:
        report = queue.get(timeout=300)
        reports[report["role"]] = report
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0, process.name

    assert [r.get("error") for r in reports.values()] == [None] * len(ROLES)
    every_patch = sorted(spec.name for spec in adapter.patch_specs())
    assert len({r["pid"] for r in reports.values()} | {os.getpid()}) == len(ROLES) + 1
    for role in ROLES:
        assert {k: v for k, v in reports[role].items() if k != "pid"} == {
            "role": role,
            "status": "active",
            "calls": 1,
            "installs": 1,
            "patched": every_patch,
            "connector": True,
        }
