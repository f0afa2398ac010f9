"""Running the server process: uvicorn on the app, and a shutdown that ends in order.

SIGTERM or Ctrl-C stops admitting (new and queued requests get 503, new connections are
refused), lets the requests in flight finish for at most `graceful_seconds`, then ends the
rest with a 503 (a stream with an error event); every generation gives its sequences back as
it ends (`Generation.close`), and the process exits with status 0. uvicorn's own handling would re-raise the signal after its shutdown (exit status
-15); here a signal is a request to shut down, not a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn
from starlette.applications import Starlette

log = logging.getLogger("kvfork.server")

#: The default bound on a graceful shutdown (`kvfork serve --shutdown-seconds`).
DEFAULT_SHUTDOWN_SECONDS = 10.0
#: How long before uvicorn's deadline the requests still in flight are ended: time for their
#: responses to finish (an error event, the end of the stream).
END_BEFORE_DEADLINE = 0.5


class _Server(uvicorn.Server):
    """uvicorn's server, whose signals start a shutdown and are not raised again after it."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_signal = on_signal

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        handled = (signal.SIGINT, signal.SIGTERM)
        try:
            for sig in handled:
                loop.add_signal_handler(sig, self.handle_exit, sig, None)
        except NotImplementedError:  # no loop signal handlers (Windows): uvicorn's own way
            with super().capture_signals():
                yield
            return
        try:
            yield
        finally:
            for sig in handled:
                loop.remove_signal_handler(sig)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            log.warning("shutting down (signal %d)", sig)
            self.on_signal()
        super().handle_exit(sig, frame)


async def run(
    app: Starlette,
    *,
    host: str,
    port: int,
    log_level: str,
    graceful_seconds: float = DEFAULT_SHUTDOWN_SECONDS,
    stop_admitting: Callable[[], None] = lambda: None,
    end_all: Callable[[], None] = lambda: None,
) -> None:
    """Serve `app` until a signal. When the shutdown starts `stop_admitting` is called, and
    `end_all` once the requests in flight have had `graceful_seconds` (a little before
    uvicorn's own deadline, so that they end in order rather than by cancellation)."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=math.ceil(graceful_seconds),
    )

    def shutting_down() -> None:
        stop_admitting()
        grace = max(0.0, graceful_seconds - END_BEFORE_DEADLINE)
        asyncio.get_running_loop().call_later(grace, end_all)

    server = _Server(config, shutting_down)
    await server.serve()
    # Requests cancelled at the end of the grace period give their sequences back as their
    # tasks end: let them run before the context closes.
    for _ in range(10):
        await asyncio.sleep(0)
