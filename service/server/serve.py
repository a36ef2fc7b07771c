"""The HTTP server process: `serve(app, settings)` runs the app with the bounded protocol (service/server/protocol.py),
the connections' caps, and the stop sequence a service behind a load balancer needs. uvicorn is reached through
service/server/uvicorn_compat.py alone; `check_uvicorn` refuses, before the model is loaded, a uvicorn the protocol
cannot run on.

The stop sequence: on SIGTERM (or SIGINT, or SIGHUP) /health/ready turns 503 at once (`on_signal`), no new connection is
accepted, requests in flight are answered (for at most ELMO_DRAIN_S seconds; then the connections whose answer is
still being sent are closed, and the requests still running cancelled: service/api/middleware.py's DrainCutoff
answers those 503), the batcher finishes its queue, and the process exits 0. A second signal stops it at once: one
line in the log, and exit status 0 (uvicorn_compat._DrainingServer.stop_now)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI

from service.api.health import LIVE_PATH, live_answer
from service.api.tracing import TraceContextGate
from service.metrics import Metrics
from service.server import uvicorn_compat
from service.server.connections import ConnectionCaps, RequestTurns, Trusted, connection_limit, raise_open_files
from service.server.hosts import AllowedHosts
from service.server.log_bounds import AddressLog
from service.server.metrics_port import MAX_CONNECTIONS, MAX_PER_CLIENT, MetricsApp
from service.server.protocol import BoundedHttpProtocol
from service.settings import Settings

log = logging.getLogger("elmo.service")


def check_uvicorn() -> str | None:
    """Why the installed uvicorn cannot run the protocol, if it cannot: its version, or the protocol's self-check
    over a real socket (about 30 ms)."""
    try:
        uvicorn_compat.check(BoundedHttpProtocol)
    except uvicorn_compat.UvicornMismatch as err:
        return str(err)
    return None


def serve(app: FastAPI, settings: Settings, on_signal: Callable[[], None], metrics: Metrics | None = None) -> bool:
    """Serve `app` until a stop signal (then drain: `on_signal` first); whether it started."""
    caps = connection_caps(settings, metrics or Metrics())
    app.state.connections = caps  # /info shows the caps in force
    trusted = settings.forwarded_allow_ips
    http = BoundedHttpProtocol.configured(
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
        live_path=LIVE_PATH,
        live=live_answer,
        hosts=AllowedHosts(settings.host, settings.allowed_hosts),
    )
    sides = (metrics_side(app, settings, http),) if settings.metrics_port is not None else ()
    # trace context only from the trusted proxies: judged by the connection's peer, before the proxy headers'
    # middleware (inside the gate here, not around it as uvicorn would put it) names the client
    forwarded = uvicorn_compat.proxy_headers(app, trusted) if trusted else app
    return uvicorn_compat.run(
        TraceContextGate(forwarded, caps.trusted),
        http,
        on_signal=on_signal,
        on_drain_cut=BoundedHttpProtocol.cut_off,
        sides=sides,
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
    )


def metrics_side(app: FastAPI, settings: Settings, main: type[BoundedHttpProtocol]) -> uvicorn_compat.SidePort:
    """ELMO_METRICS_PORT: /metrics alone, without keys, on the main port's protocol and bounds (its head timeout,
    header limits, pipelining and write timeout), with connection caps of its own and no turns or liveness
    answer (service/server/metrics_port.py)."""
    caps = ConnectionCaps(MAX_CONNECTIONS, MAX_PER_CLIENT, Trusted([]), main.address_log)
    # one Host per request, of any name: /metrics alone, for a scraper that names the target as it was configured
    http = main.configured(caps=caps, turns=None, trusted=Trusted([]), live=None, hosts=AllowedHosts("", []))
    return uvicorn_compat.SidePort(
        MetricsApp(app),
        http,
        settings.host,
        settings.metrics_port,
        timeout_keep_alive=settings.keep_alive_s,
    )


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
