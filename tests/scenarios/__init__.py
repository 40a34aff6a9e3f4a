"""Test-only SimEngine scenarios (CPU offload, prompt-tail and output checkpoints, a NIXL P/D pair).

They drive the installed wheel's real scheduler the way several test files need; they are
not part of the plugin's wheel (``tests/test_packaging.py`` checks that, and the
``import-linter`` contracts in ``pyproject.toml`` keep the package from importing them).
Importable as ``scenarios.<module>`` because pytest puts ``tests/`` on ``sys.path``.
"""
