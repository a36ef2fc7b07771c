"""The HTTP server process: uvicorn with the bounded protocol (service/api/protocol.py) and the stop sequence a
service behind a load balancer needs. The protocol extends uvicorn's internals, which a uvicorn release may change
without notice: `serve` refuses a uvicorn outside the tested range, or one missing an internal the protocol uses,
with a message that says which to install, instead of running with its defences silently broken."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware, _TrustedHosts
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.api.connections import ConnectionCaps, RequestTurns, Trusted, connection_limit, raise_open_files
from service.api.log_bounds import AddressLog
from service.api.protocol import BoundedHttpProtocol
from service.api.tracing import TraceContextGate
from service.metrics import Metrics
from service.settings import Settings

log = logging.getLogger("elmo.service")
# The uvicorn releases the protocol was tested with: at least the first, below the second (pyproject.toml says the
# same, and tests/service/api/test_server.py holds the two together).
UVICORN_TESTED = ((0, 54), (0, 55))
# What of uvicorn's internals the protocol and the server override or call.
INTERNALS = {
    HttpToolsProtocol: (
        "_unset_keepalive_if_required", "_should_upgrade", "_get_upgrade", "handle_websocket_upgrade",
        "_unsupported_upgrade_warning", "_start_asgi_task", "on_response_complete", "on_message_begin", "on_url",
        "on_header", "on_headers_complete",
        "pause_writing", "resume_writing", "eof_received", "connection_lost", "connection_made", "data_received",
    ),
    uvicorn.Server: ("handle_exit", "shutdown", "_wait_tasks_to_complete"),
    _TrustedHosts: ("__contains__", "get_trusted_client_address"),
}  # fmt: skip


def uvicorn_problem(version: str = uvicorn.__version__) -> str | None:
    """Why this uvicorn cannot run the service's protocol, if it cannot: outside the tested range, or an internal
    gone."""
    low, high = UVICORN_TESTED
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    wanted = f"uvicorn>={low[0]}.{low[1]},<{high[0]}.{high[1]}"
    if len(parts) < 2 or not low <= parts < high:
        return (
            f"uvicorn {version} is installed, and elmo-serve's HTTP protocol extends uvicorn's internals as of the "
            f"releases it was tested with: install '{wanted}'"
        )
    missing = [f"{cls.__name__}.{name}" for cls, names in INTERNALS.items() for name in names if not hasattr(cls, name)]
    if missing:
        return (
            f"uvicorn {version} lacks {', '.join(missing)}, which elmo-serve's HTTP protocol uses: install '{wanted}'"
        )
    return None


def serve(app: FastAPI, settings: Settings, on_signal: Callable[[], None], metrics: Metrics | None = None) -> bool:
    """Serve `app` until a stop signal (then drain: `on_signal` first); whether it started."""
    caps = connection_caps(settings, metrics or Metrics())
    app.state.connections = caps  # /info shows the caps in force
    trusted = settings.forwarded_allow_ips
    config = uvicorn.Config(
        # trace context only from the trusted proxies: judged by the connection's peer, before uvicorn's proxy
        # headers middleware (here inside the gate, not around it as uvicorn would put it) names the client
        TraceContextGate(ProxyHeadersMiddleware(app, trusted_hosts=trusted) if trusted else app, caps.trusted),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        # JSON: uvicorn's lines through the process's one handler (service/logs.py); text: uvicorn's own format
        **({"log_config": None} if settings.log_format == "json" else {}),
        access_log=False,  # the service's own access line, with the request id: ELMO_ACCESS_LOG
        ws="none",  # no route is a WebSocket: an upgrade is refused by the protocol before anything logs it
        # X-Forwarded-For only from the proxies named (uvicorn's default trusts 127.0.0.1's: any local process's)
        proxy_headers=False,  # applied above, inside the trace context gate
        forwarded_allow_ips=trusted,
        timeout_graceful_shutdown=settings.drain_s,
        timeout_keep_alive=settings.keep_alive_s,
        http=BoundedHttpProtocol.configured(
            head_timeout_s=settings.head_timeout_s,
            max_header_bytes=settings.max_header_bytes,
            max_headers=settings.max_headers,
            max_pipelined=settings.max_pipelined,
            write_timeout_s=settings.write_timeout_s,
            answer_half_closed=settings.answer_half_closed,
            caps=caps,
            turns=RequestTurns(),
            trusted=caps.trusted,
            address_log=caps.address_log,
        ),
    )
    server = DrainingServer(config, on_signal=on_signal)
    server.run()
    return server.started


def connection_caps(settings: Settings, metrics: Metrics) -> ConnectionCaps:
    """The connections' caps in force: the soft open-files limit raised to the hard one first, the caps below it."""
    before, open_files = raise_open_files()
    limit = connection_limit(open_files, settings.max_connections)
    per_client = min(settings.max_connections_per_client, max(1, limit // 2))  # others keep half at least
    raised = f"raised from {before} to {open_files}" if open_files != before else f"{open_files}"
    log.info(
        "open files: %s; connections: at most %d, %d from one address%s",
        raised,
        limit,
        per_client,
        f" (ELMO_MAX_CONNECTIONS={settings.max_connections} is over what the open-files limit allows)"
        if settings.max_connections > limit
        else "",
    )
    caps = ConnectionCaps(
        limit,
        per_client,
        Trusted(settings.forwarded_allow_ips),
        AddressLog(log),
        refused=lambda reason: metrics.connections_refused.labels(reason).inc(),
    )
    metrics.connections.set_function(lambda: caps.count)
    return caps


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

    async def _wait_tasks_to_complete(self) -> None:
        try:
            await super()._wait_tasks_to_complete()
        except asyncio.CancelledError:
            # The drain bound has passed, and uvicorn cancels the requests still running next: first close the
            # connections of those whose answer is being sent, which cannot be finished, so that they end quietly
            # (uvicorn logged a CancelledError traceback for each).
            for connection in list(self.server_state.connections):
                if isinstance(connection, BoundedHttpProtocol):
                    connection.cut_off()
            raise
