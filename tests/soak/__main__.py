"""``PYTHONPATH=tests python -m soak``: the long seeded soak of :mod:`soak.harness`.

It runs under a private temp root (TMPDIR), as ``hybrid-kv`` commands do: torch's compile cache
went to /tmp/torchinductor_<user> and stayed there."""

from hybrid_kv_plugin.models.environment import private_temp_root

with private_temp_root():
    from soak.harness import main

    code = main()
raise SystemExit(code)
