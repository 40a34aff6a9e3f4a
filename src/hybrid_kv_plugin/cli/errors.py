"""The CLI's one way to refuse bad input: ``fail()`` raises ``SystemExit("hybrid-kv: ...")``, which
:func:`hybrid_kv_plugin.cli.main.console_main` prints as one line and turns into exit 2.

It lives alone so every command module (``args`` included, which the others import) can use it
without an import circle."""

from __future__ import annotations

from typing import NoReturn


def fail(message: str) -> NoReturn:
    raise SystemExit(f"hybrid-kv: {message}")
