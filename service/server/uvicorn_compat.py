"""Every use of uvicorn and httptools in the service, in one module (an import contract forbids them anywhere else).

uvicorn's public API (`Config`, `Server.run`) serves an ASGI app, but leaves the bounds of service/server/protocol.py
to no setting: the protocol extends uvicorn's httptools protocol, and so depends on its private names (methods such
as `_start_asgi_task`, instance attributes such as `cycle`, `pipeline`, `response_started`), which a uvicorn release
may rename without notice. Here each of them is given a name of the service's own, once, and two checks guard them
before the server starts (`check`):

- the version: uvicorn outside the releases the protocol was tested with is refused, saying which to install;
- a live self-check: the protocol to be served runs six exchanges over a real socket on 127.0.0.1 (a request,
  two pipelined, a chunked body with a trailer, a WebSocket upgrade, an h2c upgrade, a client gone mid-body), and
  every name below is used on a live instance. A name uvicorn no longer has fails with the uvicorn version and
  the name in the message, before the first request, instead of leaving a defence silently broken (a class-level
  `hasattr` cannot see an instance attribute renamed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import httptools
import uvicorn
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware, _TrustedHosts
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

log = logging.getLogger("elmo.service")
VERSION = uvicorn.__version__
# The uvicorn releases the protocol was tested with: at least the first, below the second (pyproject.toml says the
# same, and tests/service/server/test_uvicorn_compat.py holds the two together).
TESTED = ((0, 54), (0, 55))
WANTED = f"uvicorn>={TESTED[0][0]}.{TESTED[0][1]},<{TESTED[1][0]}.{TESTED[1][1]}"
# The methods of uvicorn's classes that this module overrides or calls (the instance attributes are checked live).
METHODS = {
    HttpToolsProtocol: (
        "_unset_keepalive_if_required", "_get_upgrade", "_should_upgrade", "handle_websocket_upgrade",
        "_unsupported_upgrade_warning", "_start_asgi_task", "on_response_complete", "on_message_begin", "on_url",
        "on_header", "on_headers_complete", "pause_writing", "resume_writing", "eof_received", "connection_lost",
        "connection_made", "data_received",
    ),
    uvicorn.Server: ("handle_exit", "capture_signals", "shutdown", "_wait_tasks_to_complete", "run"),
    _TrustedHosts: ("__contains__", "get_trusted_client_address"),
}  # fmt: skip

ParserError = httptools.HttpParserError  # a request that is not HTTP/1.1
ParserUpgrade = httptools.HttpParserUpgrade  # the parser stopped at an upgrade: it parses nothing after it
Cycle = RequestResponseCycle  # one request and its answer (typing only: what follows reads it)


class UvicornMismatch(RuntimeError):
    """The installed uvicorn is not one the protocol can run on."""


def version_problem(version: str = VERSION) -> str | None:
    """Why this uvicorn cannot run the protocol, if it cannot: outside the tested range, or a method gone."""
    low, high = TESTED
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if len(parts) < 2 or not low <= parts < high:
        return (
            f"uvicorn {version} is installed, and elmo-serve's HTTP protocol extends uvicorn's internals as of the "
            f"releases it was tested with: install '{WANTED}'"
        )
    missing = [f"{cls.__name__}.{name}" for cls, names in METHODS.items() for name in names if not hasattr(cls, name)]
    if missing:
        uses = "which elmo-serve's HTTP protocol uses"
        return f"uvicorn {version} lacks {', '.join(missing)}, {uses}: install '{WANTED}'"
    return None


def status_line(status: int) -> bytes:
    """`HTTP/1.1 <status> <reason>\\r\\n`, as uvicorn writes it."""
    return STATUS_LINE[status]


# -- a request and its answer (uvicorn's RequestResponseCycle)


def answer_started(cycle: Cycle) -> bool:
    return cycle.response_started


def answer_complete(cycle: Cycle) -> bool:
    return cycle.response_complete


def body_all_in(cycle: Cycle) -> bool:
    """Whether the request's body has all arrived (parsed to its end)."""
    return not cycle.more_body


def body_held(cycle: Cycle) -> int:
    """Bytes of the request's body read and not yet taken by the app."""
    return len(cycle.body)


def gone(cycle: Cycle) -> None:
    """Tell the request's app that its client has gone (its next `receive` says http.disconnect)."""
    cycle.disconnected = True
    cycle.message_event.set()


def client_gone(cycle: Cycle) -> bool:
    return cycle.disconnected


def close_after(cycle: Cycle) -> None:
    """Close the connection once this answer is sent."""
    cycle.keep_alive = False


def scope_of(cycle: Cycle) -> dict:
    return cycle.scope


# -- the connection


class Flow(FlowControl):
    """uvicorn's flow control, except that reading resumes only while `may_read()` says so."""

    def __init__(self, transport: asyncio.Transport, may_read: Callable[[], bool]):
        super().__init__(transport)
        self.may_read = may_read

    def resume_reading(self) -> None:
        if self.may_read():
            super().resume_reading()


class HttpBase(HttpToolsProtocol):
    """uvicorn's httptools protocol under names of the service's own: what a subclass overrides (`start_request`,
    `other_upgrade`, `may_read`, and httptools' parser callbacks, which are httptools' public names), calls, and
    reads. Its transport, loop and peer are kept by this class itself (`wire`, `event_loop`, `peer`)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.wire = transport
        self.event_loop = asyncio.get_running_loop()
        peer = transport.get_extra_info("peername")
        self.peer = peer[0] if isinstance(peer, tuple) else ""
        self.flow = Flow(transport, self.may_read)

    # what a subclass overrides

    def may_read(self) -> bool:
        """Whether reading may resume (uvicorn resumes it once an answer is sent, or the app wants more body)."""
        return True

    def start_request(self, cycle: Cycle, app) -> None:
        """A request's head is in and its turn has come: start its task (`run_request`)."""
        self.run_request(cycle, app)

    def other_upgrade(self) -> None:
        """An upgrade to something other than a WebSocket the server serves (h2c): uvicorn logs warnings."""
        HttpToolsProtocol._unsupported_upgrade_warning(self)

    # uvicorn's hooks, routed to the names above

    def _start_asgi_task(self, cycle: Cycle, app) -> None:
        self.start_request(cycle, app)

    def _unsupported_upgrade_warning(self) -> None:
        self.other_upgrade()

    # what a subclass calls

    def run_request(self, cycle: Cycle, app) -> None:
        HttpToolsProtocol._start_asgi_task(self, cycle, app)

    def stop_keep_alive_timer(self) -> None:
        self._unset_keepalive_if_required()

    def upgrade_asked(self) -> bytes | None:
        """The protocol the request's Upgrade header asks for, if its Connection header says upgrade."""
        return self._get_upgrade()

    def upgrade_served(self) -> bool:
        """Whether the request asks for a WebSocket upgrade and the server serves WebSockets."""
        return self._should_upgrade()

    def upgrade_to_websocket(self) -> None:
        self.handle_websocket_upgrade()

    def pause_reads(self) -> None:
        self.flow.pause_reading()

    def resume_reads(self) -> None:
        self.flow.resume_reading()

    # what a subclass reads

    @property
    def current(self) -> Cycle | None:
        """The request parsed last (being answered, or waiting behind others)."""
        return self.cycle

    @property
    def waiting(self):
        """The requests parsed and waiting behind the one being answered (a deque of (cycle, app), newest left)."""
        return self.pipeline

    @property
    def http_parser(self):
        """httptools' parser of this connection (None once it is lost)."""
        return self.parser

    @property
    def head_fields(self) -> list[tuple[bytes, bytes]]:
        """The header fields of the request being parsed, as uvicorn has kept them."""
        return self.headers

    @property
    def server_headers(self) -> list[tuple[bytes, bytes]]:
        """The headers uvicorn puts on every answer (date, server)."""
        return self.server_state.default_headers

    @property
    def mounted_at(self) -> str:
        """The app's root path."""
        return self.root_path


class TrustedProxies:
    """The reverse proxies named (addresses and networks), and the client a request they forward names in its
    X-Forwarded-For, as uvicorn's own proxy-headers middleware reads it for the app."""

    def __init__(self, proxies: list[str]):
        self.hosts = _TrustedHosts(proxies) if proxies else None

    def __contains__(self, address: str) -> bool:
        return self.hosts is not None and address in self.hosts

    def client(self, forwarded: str) -> str | None:
        """The rightmost address of X-Forwarded-For that is not a trusted proxy."""
        if self.hosts is None:
            return None
        host, _ = self.hosts.get_trusted_client_address(forwarded)
        return host or None


# -- the server


def proxy_headers(app, trusted: str):
    """`app` behind uvicorn's X-Forwarded-For/-Proto middleware for the proxies `trusted` names: what uvicorn's
    `proxy_headers=True` wraps the app in, given to the caller to place (service/server/serve.py puts the trace
    context gate around it, so that the gate judges the connection's own peer)."""
    return ProxyHeadersMiddleware(app, trusted_hosts=trusted)


def run(
    app,
    http: type[HttpBase],
    on_signal: Callable[[], None],
    on_drain_cut: Callable[[HttpBase], None],
    sides: tuple[SidePort, ...] = (),
    **settings: Any,
) -> bool:
    """Serve `app` with uvicorn's public settings (`settings`: host, port, timeouts...) and the `http` protocol,
    until a stop signal: `on_signal` first, then the drain; a request still running when the drain bound has
    passed is cancelled, after `on_drain_cut` on each connection. `sides`: other ports served in the same event
    loop, from before the lifespan's start-up to after its shutdown. Whether the server started."""
    server = _DrainingServer(uvicorn.Config(app, http=http, **settings), on_signal, on_drain_cut, sides)
    server.run()
    return server.started


class SidePort:
    """Another port (the metrics port), served by `http` in the main server's event loop: listening before the
    lifespan's start-up (the models load), through the drain, closed after the lifespan's shutdown. Its
    connections and requests are its own (a ServerState of their own): the main port's drain neither waits for
    them nor closes them. `settings`: uvicorn's (timeout_keep_alive...)."""

    def __init__(self, app, http: type[HttpBase], host: str, port: int, backlog: int = 128, **settings: Any):
        self.config = uvicorn.Config(
            app, http=http, host=host, port=port, backlog=backlog, lifespan="off", ws="none", log_config=None,
            access_log=False, proxy_headers=False, **settings,
        )  # fmt: skip
        self.state = ServerState()
        self.server: asyncio.AbstractServer | None = None

    @property
    def connections(self) -> set:
        return self.state.connections

    async def start(self) -> None:
        self.config.load()
        loop = asyncio.get_running_loop()
        config, state = self.config, self.state

        def made() -> HttpBase:
            return config.http_protocol_class(config=config, server_state=state, app_state={}, _loop=loop)

        self.server = await loop.create_server(made, host=config.host, port=config.port, backlog=config.backlog)

    async def stop(self, wait_s: float = 1.0) -> None:
        """Stop listening; close the connections (an answer being sent gets `wait_s` to finish)."""
        if self.server is None:
            return
        self.server.close()
        for connection in list(self.state.connections):
            connection.shutdown()  # uvicorn's: closed now if idle, else after its answer
        deadline = asyncio.get_running_loop().time() + wait_s
        while self.state.connections and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        for connection in list(self.state.connections):
            connection.wire.abort()
        self.server = None


# The signals that stop the server: each drains it, a second one stops it at once. SIGHUP too: its default action
# killed the process at once, with no drain and no line in the log (two requests in flight got empty replies).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class _DrainingServer(uvicorn.Server):
    """uvicorn, stopped the way a service behind a balancer should be (service/server/serve.py says how). uvicorn
    itself would raise the signal again once done, so the process would end killed by SIGTERM, not with status 0."""

    def __init__(self, config: uvicorn.Config, on_signal, on_drain_cut, sides: tuple[SidePort, ...] = ()):
        super().__init__(config)
        self.on_signal, self.on_drain_cut, self.sides = on_signal, on_drain_cut, sides

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        for side in self.sides:  # before the lifespan: the metrics answer while the models load
            await side.start()
        await super().startup(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's, with SIGHUP among the signals, and none raised again afterwards."""
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only
            return
        before = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self.stop_now(sig)
        self.on_signal()
        self.should_exit = True

    def stop_now(self, sig: int) -> None:
        """A second signal: stop now, without waiting for the requests in flight (their connections are closed by
        the process's end). uvicorn's own "force exit" skipped the lifespan's shutdown and left asyncio to cancel
        every task while ONNX Runtime's threads were still computing: a CancelledError traceback when idle, and
        under load an abort ("terminate called without an active exception", exit 134) as the interpreter
        finalized around them. Ending the process here, with nothing finalized, cannot abort."""
        log.warning(
            "a second stop signal (%s): stopping now, without waiting for the %d request(s) in flight",
            signal.Signals(sig).name,
            len(self.server_state.tasks),
        )
        for stream in [*logging.getLogger().handlers, *log.handlers, sys.stdout, sys.stderr]:
            with contextlib.suppress(Exception):  # a stream already closed: nothing left to write
                stream.flush()
        os._exit(0)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        log.info(
            "draining: not ready, no new connections; requests in flight get %s s",
            self.config.timeout_graceful_shutdown,
        )
        try:
            await super().shutdown(sockets)
        finally:
            for side in self.sides:  # after the drain and the lifespan's shutdown: scraped until the end
                await side.stop()

    async def _wait_tasks_to_complete(self) -> None:
        try:
            await super()._wait_tasks_to_complete()
        except asyncio.CancelledError:
            # The drain bound has passed, and uvicorn cancels the requests still running next: first close the
            # connections of those whose answer is being sent, which cannot be finished, so that they end quietly
            # (uvicorn logged a CancelledError traceback for each).
            for connection in list(self.server_state.connections):
                if isinstance(connection, HttpBase):
                    self.on_drain_cut(connection)
            raise


# -- the checks at start-up


def check(protocol: type[HttpBase], timeout_s: float = 5.0) -> None:
    """Raise UvicornMismatch, with the uvicorn version and what is wrong, unless this uvicorn is in the tested range
    and a live instance of `protocol` answers the self-check's exchanges with every name of this module working."""
    if problem := version_problem():
        raise UvicornMismatch(problem)
    try:
        failures = asyncio.run(asyncio.wait_for(_exchanges(protocol), timeout_s))
    except (TimeoutError, asyncio.TimeoutError):
        failures = [f"the exchanges did not end within {timeout_s:g} s"]
    if failures:
        failures = list(dict.fromkeys(failures))  # each once: a name gone fails every exchange alike
        more = f"; and {len(failures) - 3} more" if len(failures) > 3 else ""
        raise UvicornMismatch(
            f"uvicorn {VERSION}: elmo-serve's HTTP protocol failed its self-check over a socket "
            f"({'; '.join(failures[:3])}{more}): a name it uses of uvicorn's internals may have changed; "
            f"install '{WANTED}'"
        )


async def _probe_app(scope, receive, send) -> None:
    """The self-check's app: reads the body, then answers its length, and the path, in the body."""
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            _probe_app.gone += 1  # type: ignore[attr-defined]
            return
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = b"%s %d" % (scope["path"].encode(), size)
    headers = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _exchanges(protocol: type[HttpBase]) -> list[str]:
    """The self-check (see the module's docstring); what failed, if anything."""
    loop = asyncio.get_running_loop()
    failures: list[str] = []
    loop.set_exception_handler(lambda _, context: failures.append(_why(context)))
    config = uvicorn.Config(_probe_app, ws="none", lifespan="off", log_config=None, access_log=False)
    config.load()
    state = ServerState()
    live: list[HttpBase] = []
    started: list[str] = []
    _probe_app.gone = 0  # type: ignore[attr-defined]

    def read_all(connection: HttpBase, cycle: Cycle) -> None:
        """Every name the protocol reads, on a live instance with a request in progress."""
        started.append(scope_of(cycle)["path"])
        read = (answer_started(cycle), answer_complete(cycle), client_gone(cycle), body_held(cycle))
        read += (body_all_in(cycle),)
        read += (connection.current, connection.waiting, connection.http_parser, connection.head_fields)
        read += (connection.server_headers, connection.mounted_at, connection.wire, connection.event_loop)
        read += (connection.peer, connection.flow.read_paused)

    def recorded(name: str):
        """`protocol`'s method `name`, with what it raises recorded: httptools turns an error in a parser callback
        into a parse error (answered 400), which would not say which name failed."""
        method = getattr(protocol, name)

        def call(self, *args):
            try:
                if name == "start_request":
                    read_all(self, args[0])
                return method(self, *args)
            except (AttributeError, TypeError, KeyError) as err:
                failures.append(f"{type(err).__name__} in {name}: {err}")
                raise

        return call

    Probed = type("Probed", (protocol,), {name: recorded(name) for name in CALLED})

    def made() -> HttpBase:
        live.append(Probed(config=config, server_state=state, app_state={}, _loop=loop))
        return live[-1]

    server = await loop.create_server(made, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        for name, request, expected in EXCHANGES:
            try:
                answer = await _exchange(port, request)
            except OSError as err:
                answer = f"{type(err).__name__}: {err}".encode()
            if not all(part in answer for part in expected):
                failures.append(f"{name}: answered {answer[:120]!r}, not {b' ... '.join(expected)!r}")
        if started[:4] != ["/one", "/two", "/three", "/chunked"]:
            expected = "/one, /two, /three, /chunked"
            failures.append(f"requests started through the protocol's hook: {started}, not {expected}")
        for _ in range(50):  # its task runs on the loop's next turns
            if _probe_app.gone:  # type: ignore[attr-defined]
                break
            await asyncio.sleep(0.01)
        else:
            failures.append("the app of a request whose client went was not told (http.disconnect)")
    finally:
        server.close()
        for connection in live:
            if getattr(connection, "wire", None) is not None:
                connection.wire.close()
        await server.wait_closed()
    return failures


# The protocol's methods uvicorn, httptools or asyncio call, watched by the self-check.
CALLED = (
    "connection_made", "connection_lost", "data_received", "eof_received", "on_message_begin", "on_url", "on_header",
    "on_headers_complete", "on_chunk_header", "on_body", "on_message_complete", "on_response_complete",
    "start_request", "other_upgrade",
)  # fmt: skip


def _why(context: dict) -> str:
    err = context.get("exception")
    return f"{type(err).__name__}: {err}" if err is not None else str(context.get("message"))


HEAD = b"host: check\r\n"
CLOSE = HEAD + b"connection: close\r\n"
EXCHANGES = [
    ("a request", b"GET /one HTTP/1.1\r\n" + CLOSE + b"\r\n", [b"200 OK", b"/one 0"]),
    (
        "two pipelined requests",
        b"GET /two HTTP/1.1\r\n" + HEAD + b"\r\nGET /three HTTP/1.1\r\n" + CLOSE + b"\r\n",
        [b"/two 0", b"/three 0"],
    ),
    (
        "a chunked body with a trailer",
        b"POST /chunked HTTP/1.1\r\n" + CLOSE + b"transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nx-t: 1\r\n\r\n",
        [b"200 OK", b"/chunked 5"],
    ),
    (
        "a WebSocket upgrade",
        b"GET /ws HTTP/1.1\r\n" + HEAD + b"connection: upgrade\r\nupgrade: websocket\r\n\r\n",
        [b"400 Bad Request"],
    ),
    (
        "an h2c upgrade",
        b"GET /h2c HTTP/1.1\r\n" + HEAD + b"connection: upgrade, http2-settings\r\nupgrade: h2c\r\n\r\n",
        [b"200 OK", b"/h2c 0"],
    ),
    ("a client gone mid-body", b"POST /gone HTTP/1.1\r\n" + HEAD + b"content-length: 10\r\n\r\nab", []),
]


async def _exchange(port: int, request: bytes) -> bytes:
    """Send `request` and read the answer until the server closes (or 0.5 s of silence)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        if request.startswith(b"POST /gone"):
            await asyncio.sleep(0.02)  # its head is in and its app waits for the body: then the client goes
            return b""
        got = b""
        while True:
            try:
                part = await asyncio.wait_for(reader.read(65536), 0.5)
            except (TimeoutError, asyncio.TimeoutError):
                return got
            if not part:
                return got
            got += part
    finally:
        writer.close()
