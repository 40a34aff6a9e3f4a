"""Mooncake-format trace lines and ``hybrid-kv replay`` runs for the replay tests (test-only)."""

from __future__ import annotations

import json
from typing import Any

from hybrid_kv_plugin.cli.main import console_main


def mooncake_line(timestamp: int, input_length: int, output_length: int, hash_ids: list[int], **extra: Any) -> str:
    """One request as the public Mooncake traces write it (``extra``: further keys, e.g. a typo)."""
    return json.dumps(
        {"timestamp": timestamp, "input_length": input_length, "output_length": output_length, "hash_ids": hash_ids, **extra}
    )


def write_trace(tmp_path: Any, lines: list[str]) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def run_replay(capsys: Any, *argv: str) -> tuple[int, str, str]:
    """``hybrid-kv replay ARGV``: exit code, stdout, stderr."""
    code = console_main(["replay", *argv])
    out, err = capsys.readouterr()
    return code, out, err
