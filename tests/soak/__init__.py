"""Test-only fault-injection harness (``harness.FaultHarness``) and its per-step invariants.

``tests/test_reliability_*.py`` and ``tests/test_invariant_checkers.py`` drive it; the long
seeded run is ``PYTHONPATH=tests python -m soak --steps 10000 --seed 0`` (see ``harness``).
Not part of the plugin's wheel.
"""
