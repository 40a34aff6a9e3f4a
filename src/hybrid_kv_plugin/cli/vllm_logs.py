"""Where vLLM's own log lines go while a ``hybrid-kv`` command runs."""

from __future__ import annotations

import os


def route_vllm_logs() -> None:
    """Before anything imports vLLM: its start-up chatter only hides the report, and vLLM logs to
    stdout by default while stdout is the report (``--json`` is parsed by scripts). A user's own
    settings win."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
