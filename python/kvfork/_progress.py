"""A one-line progress display on stderr for the `kvfork` command (model assembly, model load,
long prefills): shown only for work that outlasts `delay`, only on a terminal (or when
``KVFORK_PROGRESS=1``), and erased when the work ends."""

from __future__ import annotations

import os
import sys
import threading
import time
from types import TracebackType
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from typing_extensions import Self


class Progress:
    """``with Progress("loading model"):`` shows ``loading model … 1.4s`` while the block runs
    (from a ticker thread, so it keeps moving while llama.cpp holds the CPU); ``update(done)``
    adds ``done/total`` for work counted in steps."""

    def __init__(
        self,
        label: str,
        *,
        total: int | None = None,
        stream: TextIO | None = None,
        delay: float = 1.0,
        enabled: bool | None = None,
    ) -> None:
        """``enabled`` None: on when ``stream`` is a terminal or ``KVFORK_PROGRESS=1``."""
        self.label = label
        self.total = total
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.delay = delay
        if enabled is None:
            enabled = os.environ.get("KVFORK_PROGRESS") == "1" or self.stream.isatty()
        self.enabled = enabled
        self.shown = False  # whether a line was written (and must be erased)
        self._start = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Self:
        self._start = time.perf_counter()
        if self.enabled:
            self._thread = threading.Thread(target=self._tick, name="kvfork-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.shown:
            elapsed = time.perf_counter() - self._start
            status = "failed" if exc_type is not None else "done"
            self.stream.write(f"\r\x1b[2K{self.label}: {status} in {elapsed:.1f}s\n")
            self.stream.flush()

    def update(self, done: int) -> None:
        """Record how many of ``total`` steps are done."""
        self.done = done

    def _tick(self) -> None:
        if self._stop.wait(self.delay):
            return
        while True:
            elapsed = time.perf_counter() - self._start
            count = f" {self.done}/{self.total}" if self.total else ""
            self.stream.write(f"\r\x1b[2K{self.label} …{count} {elapsed:.1f}s")
            self.stream.flush()
            self.shown = True
            if self._stop.wait(0.1):
                return
