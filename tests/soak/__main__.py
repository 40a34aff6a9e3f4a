"""``PYTHONPATH=tests python -m soak``: the long seeded soak of :mod:`soak.harness`."""

from soak.harness import main

raise SystemExit(main())
