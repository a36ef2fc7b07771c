"""The HTTP server process: uvicorn, with the stop sequence a service behind a load balancer needs."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn

log = logging.getLogger("elmo.service")


class DrainingServer(uvicorn.Server):
    """uvicorn, stopped the way a service behind a balancer should be: on SIGTERM (or SIGINT) /health/ready
    turns 503 at once, no new connection is accepted, requests in flight are answered (for at most
    `timeout_graceful_shutdown` seconds, then cancelled), the batcher finishes its queue, and the process
    exits 0. A second signal stops waiting. (uvicorn itself would raise the signal again once done, so the
    process would end killed by SIGTERM, not with status 0.)"""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]):
        super().__init__(config)
        self.on_signal = on_signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.on_signal()
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        log.info(
            "draining: not ready, no new connections; requests in flight get %s s",
            self.config.timeout_graceful_shutdown,
        )
        await super().shutdown(sockets)
