"""A warm pytest starter for ``scripts/mutants``: vLLM imported once, one forked child per mutant run.

A one-test mutant run spent most of its CPU before its test: importing the vLLM
modules the plugin's ``register()`` reaches (~37 CPU s on a loaded 2-core host) and
vLLM's model inspection of the simulator's model in a subprocess (~38 CPU s; cached
on disk under ``VLLM_CACHE_ROOT``, which ``scripts/mutants`` now shares between the
runs of one wheel). This worker, started in a wheel's environment, learns which
modules those are from a forked probe (the unmutated plugin registered and one
simulated engine built, in a child that then exits), imports them once, then for
each request on stdin forks a child that puts the mutant's scratch ``src`` first on
``sys.path`` and runs pytest there. The plugin itself is never imported here: each
child imports the mutated copy, as a fresh interpreter with ``PYTHONPATH`` would.

Protocol (one JSON object per line):
    stdin:  {"src": DIR, "tests": [...], "env": {...}, "log": FILE}
    stdout: {"ready": true} once, then {"rc": N} per request

Invariants: a fork happens only while this process runs one OS thread (a lock
held by another thread would stay held in the child forever); if the imports
leave more threads, or pulled the plugin in, the worker says so and exits, and
``scripts/mutants`` runs that wheel's mutants in fresh interpreters instead.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

# OpenBLAS starts its thread pool when numpy is imported; one thread keeps the worker forkable
# (the mutant runs assert scheduler numbers, not BLAS speed).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# Imported whatever the probe finds: the test runner and the randomized suite's engine.
BASE_MODULES = ("pytest", "hypothesis")
PLUGIN = "hybrid_kv_plugin"


def _probe_modules() -> list[str]:
    """The modules a test session's set-up imports, learned in a forked child (nothing stays here)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        names: list[str] = []
        try:
            import hybrid_kv_plugin
            from hybrid_kv_plugin.adapters import select_adapter
            from hybrid_kv_plugin.sim import HybridGeometry, SimEngine

            adapter = select_adapter().adapter
            hybrid_kv_plugin.register()
            if adapter is not None:
                SimEngine(HybridGeometry(), adapter=adapter)  # also fills the shared inspection cache
            hybrid_kv_plugin.uninstall()
            names = [n for n in sys.modules if not n.startswith(PLUGIN) and not n.startswith("__")]
        except BaseException as exc:  # noqa: BLE001 - the worker then warms the base modules only
            print(f"mutant_worker: probe failed: {exc!r}", file=sys.stderr, flush=True)
        with os.fdopen(write, "w") as out:
            out.write(json.dumps(names))
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as inp:
        data = inp.read()
    os.waitpid(pid, 0)
    return json.loads(data or "[]")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _run_child(request: dict) -> None:
    """In the forked child: run pytest on the mutant's copy, then leave without cleanup handlers."""
    code = 3
    try:
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.environ.update(request["env"])
        src = request["src"]
        sys.path.insert(0, src)
        import pytest

        code = int(pytest.main(["-x", "-q", "-p", "no:cacheprovider", *request["tests"]]))
    except BaseException as exc:  # noqa: BLE001 - the parent only sees the exit code
        print(f"mutant_worker: {exc!r}", flush=True)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> int:
    # The replies get a private copy of stdout: vLLM's logger writes to stdout.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for name in (*BASE_MODULES, *_probe_modules()):
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module that imports only in a certain context stays cold
            pass
    problem = None
    if any(m == PLUGIN or m.startswith(PLUGIN + ".") for m in sys.modules):
        problem = "importing vLLM imported the plugin"
    elif _threads() != 1:
        problem = f"{_threads()} threads after the imports"
    print(json.dumps({"ready": problem is None, "problem": problem}), file=replies, flush=True)
    if problem is not None:
        return 1
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            sys.stdin.close()
            replies.close()
            _run_child(request)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), file=replies, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
