"""Progress on stderr for ``replay`` and ``bench``."""

from __future__ import annotations

import sys
from typing import Any, TextIO


class Progress:
    """A redrawn bar with an ETA on a terminal; elsewhere (``lines=True``) a line each time the
    run passes another 10 % (one line per update), so a log file stays readable, and one at
    least every ``every_s`` seconds in between (a full trace runs for minutes per 10 %).

    ``start(label, total)`` begins a run of its own (``replay``: one per configuration, so a
    one-request trace reads "1/1" and the ETA is the configuration's); ``start(label)`` goes on
    counting toward the total given at construction (``bench``: one bar over every run).
    """

    def __init__(
        self,
        total: int,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        lines: bool = False,
        clock: Any = None,
        every_s: float = 60.0,
    ) -> None:
        import time

        self.stream = stream or sys.stderr
        self.total = max(total, 1)
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.lines = lines and not self.enabled
        self.clock = clock or time.monotonic
        self.started = self.clock()
        self.base = 0
        self.label = ""
        self.next_tenth = 1
        self.every_s = every_s
        self.last_line = self.started

    def start(self, label: str, total: int | None = None) -> None:
        self.label = label
        if total is not None:  # a run of its own: its count, tenths and clock start afresh
            self.total = max(total, 1)
            self.base = 0
            self.next_tenth = 1
            self.started = self.clock()
            self.last_line = self.started

    def _eta(self, done: int, now: float | None = None) -> str:
        elapsed = (self.clock() if now is None else now) - self.started
        if done <= 0:
            return f"{elapsed:.0f}s elapsed"
        left = elapsed * (self.total - done) / done
        return f"{elapsed:.0f}s elapsed, ETA {left:.0f}s"

    def update(self, done_in_run: int) -> None:
        done = self.base + done_in_run
        if self.lines:
            tenth = min(10, done * 10 // self.total)
            now = self.clock()
            if tenth >= self.next_tenth:  # one line however many tenths this update crossed
                percent = tenth * 10
                self.next_tenth = tenth + 1
            elif now - self.last_line >= self.every_s:  # a quiet stretch: a line with the exact share
                percent = done * 100 // self.total
            else:
                return
            self.stream.write(f"{self.label}: {done}/{self.total} requests ({percent}%), {self._eta(done, now)}\n")
            self.stream.flush()
            self.last_line = now
            return
        if not self.enabled:
            return
        width = 30
        filled = width * done // self.total
        self.stream.write(
            f"\r{self.label:<16} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} requests, {self._eta(done)}"
        )
        self.stream.flush()

    def finish_run(self, requests: int) -> None:
        self.base += requests

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()
