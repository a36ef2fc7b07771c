"""The HTTP server process: uvicorn, with the stop sequence a service behind a load balancer needs, and the
bounds on request heads and idle connections that uvicorn's httptools protocol lacks."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from types import FrameType

import httptools
import orjson
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

log = logging.getLogger("elmo.service")
LINGER_S = 2.0  # after refusing a request head, how long what the client still sends is read and dropped


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


class _HeadRefused(Exception):
    """Raised from a parser callback to stop parsing a request head over a bound."""


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with what it leaves unbounded:

    - time: a request line and headers must arrive within `head_timeout_s` of the connection opening (for its
      first request) or of their first byte (408 and closed after that); a connection that sends nothing is
      closed then. Between requests uvicorn's keep-alive timeout closes an idle connection.
    - size: at most `max_header_bytes` of request line and headers, in at most `max_headers` headers (431 and
      closed beyond). httptools buffers a header until its line ends, so a head still incomplete is also
      measured by the bytes that came for it.
    - order: a valid request pipelined before garbage on the same connection is answered first, then the
      garbage gets its 400 (uvicorn answers 400 at once and closes, so the valid request's answer was lost).

    Refusals are JSON `{"detail": ...}` like the service's own, and close the connection."""

    head_timeout_s = 10.0
    max_header_bytes = 16384
    max_headers = 100

    @classmethod
    def configured(cls, head_timeout_s: float, max_header_bytes: int, max_headers: int) -> type[BoundedHttpProtocol]:
        """This protocol with these bounds (uvicorn makes one per connection from the class it is given)."""
        bounds = {"head_timeout_s": head_timeout_s, "max_header_bytes": max_header_bytes, "max_headers": max_headers}
        return type(cls.__name__, (cls,), bounds)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._in_head = False  # a request line has begun and its headers have not ended
        self._head_bytes = 0  # of the head in progress, from the parser's callbacks
        self._head_raw = 0  # bytes that came while a head was in progress, counted from its second read on
        self._head_refusal: tuple[int, str] | None = None  # why a parser callback stopped the parser
        self._refusal: bytes | None = None  # the answer to a bad request, sent once those before it are answered

    # -- the connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        if self._refusal is not None:
            return  # a bad request came: nothing after it is read, and its answer waits for those before it
        if self._in_head:
            self._head_raw += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            self._refuse(*(self._head_refusal or (400, "request: not valid HTTP/1.1")))
            return
        if self._in_head and self._head_raw > self.max_header_bytes:
            self._refuse(431, self._too_large())

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._refusal is not None and not self._answering() and not self.transport.is_closing():
            self._send_refusal()

    # -- parser callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes, self._head_raw = True, 0, 0
        if self._head_timer is None:  # the first request's runs from the connection's start
            self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self._grow(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._grow(len(name) + len(value) + 4)  # with ": " and CRLF
        if len(self.headers) >= self.max_headers:
            limit = self.max_headers
            self._head_refusal = (431, f"headers: over {limit} of them; the limit is {limit} per request")
            raise _HeadRefused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head_timer()
        super().on_headers_complete()

    # -- bounds

    def _grow(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > self.max_header_bytes:
            self._head_refusal = (431, self._too_large())
            raise _HeadRefused

    def _too_large(self) -> str:
        return f"headers: the request line and headers are over the limit of {self.max_header_bytes} bytes"

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._in_head:
            self._refuse(408, f"headers: not all in within {self.head_timeout_s:g} s; send them at once")
        elif not self._answering():
            self.transport.close()  # connected and sent nothing: there is no request to answer

    def _answering(self) -> bool:
        """Whether requests that came before are still being answered (pipelined ones included)."""
        return bool(self.pipeline) or (self.cycle is not None and not self.cycle.response_complete)

    def _refuse(self, status: int, detail: str) -> None:
        """Answer `status` and close, after the answers to the requests before it (HTTP/1.1 answers in order)."""
        self._cancel_head_timer()
        body = orjson.dumps({"detail": detail})
        head = [STATUS_LINE[status]]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body)]
        self._refusal = b"".join([*head, b"connection: close\r\n\r\n", body])
        if not self._answering():
            self._send_refusal()

    def _send_refusal(self) -> None:
        self.transport.write(self._refusal)
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        # Closing a socket with unread bytes resets the connection, and the client may lose the answer before it
        # reads it (a 1 MB header is still arriving): end the sending side, read and drop what still comes for
        # a moment, then close.
        self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)
