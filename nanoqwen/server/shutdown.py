"""Graceful shutdown: uvicorn's server with a drain of the engine before its own shutdown.

Left to itself, uvicorn on SIGTERM / SIGINT closes the listening socket at once, gives open
requests `timeout_graceful_shutdown` seconds and then cancels their tasks (a stream is cut
with no error event and no [DONE], a queued request dies with a plain-text 500), and after
`serve()` returns it re-raises the signal, which kills the process before our cleanup runs.
`GracefulServer` replaces its signal handler (`handle_exit`, installed by `capture_signals`)
with a drain, run on the event loop:

1. `Worker.drain`: no new generation is taken (a new request gets a JSON 503 while the socket
   stays open; /health says 503 too) and the queued ones get a JSON 503 now;
2. the running generation has `grace_s` seconds to finish (a second signal ends the wait);
3. `Worker.abort_running`: a generation still running ends with EngineDown, so its stream
   gets an error event and `data: [DONE]` (a non-streamed request a JSON 503);
4. `should_exit`: uvicorn's own shutdown, whose `timeout_graceful_shutdown` is only the
   backstop for responses still being written.

The signal is not recorded for re-raising, so `serve()` returns, the caller closes the
engine and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
from types import FrameType
from typing import Any

import uvicorn

POLL_S = 0.02  # how often the drain looks at the worker

log = logging.getLogger("nanoqwen.server")


class GracefulServer(uvicorn.Server):
    """A uvicorn server whose SIGTERM / SIGINT drains `worker` first (module docstring)."""

    def __init__(self, config: uvicorn.Config, worker: Any, grace_s: float) -> None:
        super().__init__(config)
        self.worker = worker
        self.grace_s = grace_s
        self._drain: asyncio.Task[None] | None = None
        self._hurry = False  # a second signal: end the running generation now

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler runs on the main thread, which runs the event loop, between any
        # two bytecodes of it: schedule the work rather than doing it here.
        asyncio.get_running_loop().call_soon_threadsafe(self._on_signal)

    def _on_signal(self) -> None:
        if self._drain is None:
            log.info(
                "shutting down: open requests get %g s to finish (signal again to end them now)",
                self.grace_s,
            )
            self._drain = asyncio.ensure_future(self.drain())
        else:
            self._hurry = True

    async def drain(self) -> None:
        try:
            self.worker.drain()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.grace_s
            while self.worker.running and not self._hurry and loop.time() < deadline:
                await asyncio.sleep(POLL_S)
            if self.worker.running:
                log.info("shutting down: ending the running generation")
                self.worker.abort_running()
        finally:
            self.should_exit = True
