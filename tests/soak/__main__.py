"""``PYTHONPATH=tests python -m soak``: the long seeded soak of :mod:`soak.harness`.

It runs under a private temp root (TMPDIR), as ``hybrid-kv`` commands do: torch's compile cache
went to /tmp/torchinductor_<user> and stayed there.

A seed names one run only under one string-hash seed: vLLM hands finished transfers over as sets of
request ids, and their order moves blocks and steps (0.33.0 ``plugin-divergence``, seed 2, async:
3,013 steps under ``PYTHONHASHSEED=0``, 3,001 under 1). So the command fixes ``PYTHONHASHSEED=0``, as
the test suite does, unless the caller set one; each summary line names it."""

import os
import sys

if "PYTHONHASHSEED" not in os.environ:
    # The interpreter reads it only at start-up: run again with it set.
    os.execve(sys.executable, [sys.executable, "-m", "soak", *sys.argv[1:]], {**os.environ, "PYTHONHASHSEED": "0"})

from hybrid_kv_plugin.models.environment import private_temp_root  # noqa: E402

with private_temp_root():
    from soak.harness import main

    code = main()
raise SystemExit(code)
