"""``register()`` under vLLM's multi-process start: one registration per process, each patching its sides.

vLLM starts the API server(s), the engine core and each worker as separate processes
(the ``spawn`` start method wherever CUDA may be initialised) and every one of them
calls ``vllm.plugins.load_general_plugins()`` - from ``EngineArgs.__post_init__``,
the start of ``EngineCore.__init__`` and ``WorkerWrapperBase.init_worker`` - which
runs each ``vllm.general_plugins`` entry point once per process. This test spawns
one process per role the same way, under the names vLLM gives them
(``ApiServer_<i>``, ``EngineCore_DP<i>``, ``VllmWorker-<rank>``; ``MainProcess`` for
``vllm serve``'s own process or an in-process engine), and asks each what the
plugin did there.

Asserted exactly: every process registers once (a second loader call changes
nothing) and registers the connector name; an API server installs no patch, a
multiprocess worker only worker-side ones, the engine core and an unnamed process
all of them (a single-process executor runs its worker inside the engine core).
"""

from __future__ import annotations

import inspect
import multiprocessing
import os

# vLLM's process name -> the role the plugin must see there.
ROLES = {"ApiServer_0": "api_server", "EngineCore_DP0": "engine_core", "VllmWorker-1": "worker", "MainProcess": "any"}


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
                "seen_as": state.role,
                "status": state.status,
                "calls": state.calls,
                "installs": state.installs,
                "patched": sorted(s.name for s in specs if is_patched(_resolve(s.target))),
                "connector": CONNECTOR_NAME in KVConnectorFactory._registry,
            }
        )
    except BaseException as exc:  # report instead of hanging the parent
        queue.put({"role": role, "error": repr(exc)})


def _stop_fork_server() -> None:
    """Stop the fork server and remove multiprocessing's temp dir (its socket) now, while the
    session's private TMPDIR still exists; left to exit time, its finaliser would find it gone."""
    from multiprocessing import forkserver, util

    forkserver._forkserver._stop()
    for finalizer in list(util._finalizer_registry.values()):
        if getattr(finalizer, "_callback", None) is util._remove_temp_dir:
            finalizer()


def test_each_spawned_process_registers_once_and_patches_its_sides(adapter, monkeypatch):
    from hybrid_kv_plugin.patches import patch_specs
    from hybrid_kv_plugin.process_role import Side

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv("HYBRID_KV_PLUGIN_DISABLE", raising=False)
    # A fork server, not a spawn per role: it imports vLLM (never the plugin) once and forks each role
    # from it, so every role starts with vLLM as a fresh process has it and the plugin not yet loaded,
    # without four full vLLM imports (about 185 of a wheel's 760 CPU s when each role was spawned).
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")  # no BLAS threads in the server that forks
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["vllm.plugins", "vllm.config", "vllm.v1.core.sched.scheduler"])
    queue = context.Queue()
    processes = [context.Process(target=_role_main, args=(name, queue), name=name) for name in ROLES]
    for process in processes:
        process.start()
    reports = {}
    for _ in ROLES:
        report = queue.get(timeout=300)
        reports[report["role"]] = report
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0, process.name
    _stop_fork_server()

    assert [r.get("error") for r in reports.values()] == [None] * len(ROLES)
    every_patch = sorted(spec.name for spec in patch_specs(adapter))
    worker_patches = sorted(spec.name for spec in patch_specs(adapter) if spec.side is Side.WORKER)
    # The engine core runs no in-process LLMEngine: front-end patches go only where one may run.
    engine_core = sorted(spec.name for spec in patch_specs(adapter) if spec.side is not Side.FRONTEND)
    expected = {"api_server": [], "engine_core": engine_core, "worker": worker_patches, "any": every_patch}
    assert len({r["pid"] for r in reports.values()} | {os.getpid()}) == len(ROLES) + 1
    for name, role in ROLES.items():
        assert {k: v for k, v in reports[name].items() if k != "pid"} == {
            "role": name,
            "seen_as": role,
            "status": "active",
            "calls": 1,
            "installs": 1,
            "patched": expected[role],
            "connector": True,
        }
    # The scheduler side is patched somewhere on every wheel (at least its config hook).
    assert "scheduler_plugin_config" in every_patch
    assert worker_patches == (["nixl_worker_pairing"] if adapter.version == "0.26.0" else [])
    assert sorted(set(every_patch) - set(engine_core)) == (
        ["step_stats_without_outputs"] if adapter.llm_engine_drops_stats_without_outputs else []
    )


def test_a_worker_goes_inert_when_a_scheduler_target_changed(no_plugin, adapter, monkeypatch):
    """Every process checks every target, so processes of one engine never disagree on inert/active."""
    import hybrid_kv_plugin
    from hybrid_kv_plugin import registration
    from vllm.v1.core.sched.scheduler import Scheduler

    def renamed(self, config, kv_cache_config, structured_output_manager, block_size, hash_block_size=None):
        raise AssertionError("never called")

    monkeypatch.setattr(multiprocessing.current_process(), "name", "VllmWorker-0")
    monkeypatch.setattr(Scheduler, "__init__", renamed)
    hybrid_kv_plugin.register()
    assert (registration.STATE.status, registration.STATE.role) == ("mismatch", "worker")
    assert registration.STATE.patch_set is None
    assert "Scheduler.__init__" in registration.STATE.reason
