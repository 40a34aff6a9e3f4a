"""The plugin's logger; ``log_once`` keeps start-up messages to one line per reason per process."""

import logging

# A child of vLLM's "vllm" logger, so the lines land in vLLM's own log with its format.
logger = logging.getLogger("vllm.hybrid_kv_plugin")

_seen: set[tuple[int, str]] = set()


def log_once(level: int, message: str, *args: object) -> None:
    key = (level, message % args if args else message)
    if key in _seen:
        return
    _seen.add(key)
    logger.log(level, message, *args)


def forget_logged() -> None:
    """Let ``log_once`` speak again (used by ``uninstall`` so a fresh register logs afresh)."""
    _seen.clear()
