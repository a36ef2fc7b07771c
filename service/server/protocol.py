"""The HTTP protocol: uvicorn's httptools protocol, with the bounds on request heads, pipelines, unread answers and
trailers that it lacks. It extends uvicorn's internals through service/server/uvicorn_compat.py alone, whose checks
refuse to start on a uvicorn that does not have them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct

from service.errors import BadRequest, ServiceError, TooSlow, http_answer
from service.server.connections import ConnectionCaps, RequestTurns, Trusted
from service.server.hosts import AllowedHosts
from service.server.log_bounds import AddressLog
from service.server.uvicorn_compat import (
    Cycle,
    HttpBase,
    ParserError,
    ParserUpgrade,
    answer_complete,
    answer_started,
    body_all_in,
    body_held,
    client_gone,
    close_after,
    gone,
    scope_of,
)

log = logging.getLogger("elmo.service")
LINGER_S = 2.0  # after refusing a request head, how long what the client still sends is read and dropped
SPOKEN = ("1.0", "1.1")  # the HTTP versions answered; another request line's version gets 505
# What is parsed at once: a read of 256 KiB can hold 6,898 pipelined requests, and httptools parses a whole read
# in one call, so reads are parsed in slices of this size, and no further while `max_pipelined` requests wait.
PARSE_SLICE = 4096
# What the kernel may hold of a connection's answer beyond what is in flight (TCP_NOTSENT_LOWAT): it grows a send
# buffer to megabytes whatever the reader's window, and took the whole 1.5 MB Swagger UI bundle into each slow
# reader's (3.7 MB of kernel memory, and the event loop's time to copy it: 2,000 of them held /health/live 8 s).
# In-flight bytes are not counted, and uvloop refills it from its own buffer without Python, so a fast reader's
# throughput is not bounded by it (a 40 MB answer took 1.3 s here with 16 KB or 128 KB).
UNSENT_BYTES = 16 << 10
TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)  # Linux's number, where Python does not name it
# A chunked body's chunks: this many are free, and past them the chunks must average CHUNK_BYTES each (bytes of
# the body so far over chunks so far). Each chunk costs a Python call or two whatever its size: an 8 MB body in
# 1-byte chunks took 4.6 s of the event loop's CPU against 0.19 s in 64 KB chunks (24x), and 14.5 -> 199 ms of
# another client's median. Ordinary clients send chunks of kilobytes (httpx and requests: 64 KB; curl: 64 KB).
FREE_CHUNKS = 1024
CHUNK_BYTES = 1024


class _HeadRefused(Exception):
    """Raised from a parser callback to stop parsing a request head over a bound."""


class BoundedHttpProtocol(HttpBase):
    """uvicorn's httptools protocol, with what it leaves unbounded:

    - time: a request line and headers must arrive within `head_timeout_s` of the connection opening (for its
      first request) or of their first byte (408 and closed after that); a connection that sends nothing is
      closed then. Between requests uvicorn's keep-alive timeout closes an idle connection.
    - size: at most `max_header_bytes` of request line and headers, in at most `max_headers` headers (431 and
      closed beyond). httptools buffers a header until its line ends, so a head still incomplete is also
      measured by the bytes that came for it.
    - order: a valid request pipelined before garbage on the same connection is answered first, then the
      garbage gets its 400 (uvicorn answers 400 at once and closes, so the valid request's answer was lost).
      A request whose own body is malformed (a bad chunk-size line, too many trailers) is answered at once.
    - pipelining: at most `max_pipelined` requests wait behind the one being answered; nothing more is read or
      parsed from the connection until they are answered (uvicorn queued every request of a read).
    - answers not read: a connection whose answer has not drained for `write_timeout_s` is closed, and what it
      held is freed (a client that never reads held its answer for as long as it liked).
    - chunks: past FREE_CHUNKS, a chunked body's chunks must average CHUNK_BYTES (400 and closed otherwise), so
      that a body costs about the same CPU in whatever chunks it comes.
    - an early answer: a request answered before its body has all arrived (401, 413) holds its connection only
      for the keep-alive timeout from its answer, unless the rest of its body has come by then (the connection is
      then kept, as before). uvicorn's keep-alive timer was cancelled by the body's next byte, and no other timer
      ran: such a connection stayed open for good.
    - trailers: the fields of a chunked body's trailer never join the request's headers (uvicorn appended them,
      so a trailer `Authorization` passed the key check); they count against the header bounds.
    - a client that closes its sending side: by default it is taken as gone (its request is cancelled, as
      nginx does); with `answer_half_closed` it still gets its answer (TCP cannot tell the two apart).
    - connections: at most `caps` allow, in all and from one address (service/server/connections.py); one past them
      is answered 503 and closed at once.
    - turns: each request is started in its address's turn (`turns`), so that one address's many connections
      cannot fill the event loop's turns; `GET /health/live` is answered outside them, by the protocol itself,
      as soon as the connection's requests before it are.
    - framing: a request of another version than HTTP/1.0 or 1.1 (a request line of HTTP/2.0) is answered 505, and
      one with no Host (in HTTP/1.1), two of them, or one `hosts` does not allow (service/server/hosts.py: a
      loopback-bound server answers loopback names only), 400. uvicorn served all of them as HTTP/1.1.
    - upgrades: a WebSocket upgrade is refused (400) before anything logs it (the server serves none: uvicorn ran
      with `ws="none"`); another upgrade (h2c) is ignored, its request answered as HTTP/1.1 and the connection
      closed after it (httptools parses nothing after an upgrade). Nothing is logged for either.

    Refusals are JSON `{"detail": ...}` like the service's own, and close the connection. What a client makes it
    log is bounded per address (`address_log`)."""

    head_timeout_s = 10.0
    max_header_bytes = 16384
    max_headers = 100
    max_pipelined = 16
    write_timeout_s = 30.0
    answer_half_closed = False
    caps: ConnectionCaps | None = None  # None: no caps
    turns: RequestTurns | None = None  # None: each request starts at once
    trusted = Trusted([])  # the reverse proxies whose X-Forwarded-For names the client
    address_log = AddressLog(log)
    live_path = "/health/live"
    live = None  # the ASGI app that answers `GET live_path` outside the turns (None: the app, in its turn)
    hosts = AllowedHosts("", [])  # any well-formed name, one per request

    @classmethod
    def configured(cls, **bounds) -> type[BoundedHttpProtocol]:
        """This protocol with these bounds (uvicorn makes one per connection from the class it is given)."""
        unknown = set(bounds) - {
            "head_timeout_s", "max_header_bytes", "max_headers", "max_pipelined", "write_timeout_s",
            "answer_half_closed", "caps", "turns", "trusted", "address_log", "live_path", "live", "hosts",
        }  # fmt: skip
        if unknown:
            raise TypeError(f"not a bound of the protocol: {', '.join(sorted(unknown))}")
        if bounds.get("live") is not None:
            bounds["live"] = staticmethod(bounds["live"])  # an ASGI app, not a method of the protocol
        return type(cls.__name__, (cls,), bounds)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._in_head = False  # a request line has begun and its headers have not ended
        self._head_bytes = 0  # of the head in progress, from the parser's callbacks
        self._head_raw = 0  # bytes that came while a head was in progress, counted from its second read on
        self._head_refusal: ServiceError | None = None  # why a parser callback stopped the parser
        self._refusal: bytes | None = None  # the answer to a bad request, sent once those before it are answered
        self._unparsed = bytearray()  # read, not parsed yet: `max_pipelined` requests wait
        self._running: Cycle | None = None  # the request being answered
        self._trailers = 0  # fields of the trailer of the body in progress
        self._chunks = 0  # chunks of the body in progress
        self._body_bytes = 0  # bytes of the body in progress
        self._write_timer: asyncio.TimerHandle | None = None
        self._peer = ""  # the connection's address
        self._turned_away = False  # refused by the connection caps: closed at once, nothing read

    # -- the connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._peer = self.peer
        if self.caps is not None and (refused := self.caps.admit(self, self._peer)):
            self._turn_away(refused)
            return
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):  # a kernel without it: the send buffer's own bound
                sock.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, UNSENT_BYTES)
        self._arm_head_timer()

    def _turn_away(self, refused: ServiceError) -> None:
        """Answer 503 and close at once: the connection is over a cap (its descriptor is freed now)."""
        self._turned_away = True
        self.wire.write(http_answer(refused))
        self.wire.close()

    def idle(self) -> bool:
        """No request in progress: connected and nothing sent yet, or idle between requests."""
        return not (self._in_head or self._answering() or self._unparsed or self._refusal or self._turned_away)

    def close_idle(self) -> None:
        """Closed to make room for another connection (the caps' limit in all is reached)."""
        self._cancel_head_timer()
        self.wire.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.caps is not None:
            self.caps.release(self, self._peer)
        self._cancel_head_timer()
        self._cancel_write_timer()
        # uvicorn marks only the request parsed last as disconnected: the one being answered (when others were
        # pipelined behind it) then wrote to a closed transport, and logged a 5 KB traceback each time.
        for cycle in (self._running, *(cycle for cycle, _ in self.waiting)):
            if cycle is not None and not answer_complete(cycle):
                gone(cycle)
        self.waiting.clear()
        self._unparsed.clear()
        super().connection_lost(exc)

    def eof_received(self) -> bool | None:
        # True keeps the connection open to write the answer; None closes it (and the request is cancelled).
        running = self._running
        if self.answer_half_closed and running is not None and not answer_complete(running):
            close_after(running)  # nothing more can come: closed once answered
            return True
        return None

    def data_received(self, data: bytes) -> None:
        if not self._answered_early():
            # More of a body already answered starts nothing: the keep-alive timer from its answer keeps running.
            self.stop_keep_alive_timer()
        if self._refusal is not None or self._turned_away:
            return  # a bad request came: nothing after it is read, and its answer waits for those before it
        self._unparsed += data
        self._parse()

    def _parse(self) -> None:
        """Parse what was read, a slice at a time, while fewer than `max_pipelined` requests wait."""
        while self._unparsed and self._refusal is None and self.http_parser is not None and not self._pipeline_full():
            piece = bytes(self._unparsed[:PARSE_SLICE])
            del self._unparsed[:PARSE_SLICE]
            self._feed(piece)
        if self._unparsed:
            self.pause_reads()  # resumed once the waiting requests are answered
        elif not self._pipeline_full() and not self._body_waits():
            self.resume_reads()

    def may_read(self) -> bool:
        # Reading stays paused while the pipelined requests are at their bound or read bytes wait to be parsed (an
        # app asking for its body resumes it otherwise).
        return not self._unparsed and not self._pipeline_full()

    def _pipeline_full(self) -> bool:
        return len(self.waiting) >= self.max_pipelined

    def _body_waits(self) -> bool:
        """The request in progress holds more body than its app took (uvicorn pauses reading for that)."""
        return self.current is not None and body_held(self.current) > 65536

    def _feed(self, data: bytes) -> None:
        if self._in_head:
            self._head_raw += len(data)
        try:
            self.http_parser.feed_data(data)
        except ParserUpgrade:
            if self.upgrade_served():
                self.upgrade_to_websocket()
            else:
                self.other_upgrade()
            self._unparsed.clear()
            return
        except ParserError:
            self._refuse(self._head_refusal or BadRequest("not valid HTTP/1.1", "request"))
            return
        if self._in_head and self._head_raw > self.max_header_bytes:
            self._refuse(self._too_large())

    def start_request(self, cycle: Cycle, app) -> None:
        self._running = cycle
        scope = scope_of(cycle)
        live = self.live is not None and scope["path"] == self.mounted_at + self.live_path
        if live and scope["method"] in ("GET", "HEAD"):
            self.run_request(cycle, self.live)  # outside the turns, and the app's middleware
        elif self.turns is None:
            self.run_request(cycle, app)
        else:
            address = self.trusted.client(self._peer, scope["headers"])
            self.turns.start(address, lambda: self._start_in_turn(cycle, app))

    def _start_in_turn(self, cycle: Cycle, app) -> None:
        if client_gone(cycle) or self.wire.is_closing():
            return  # the client went while the request waited for its turn: nothing to answer
        self.run_request(cycle, app)

    def _answered_early(self) -> bool:
        """Whether the request in progress has been answered before its body has all arrived."""
        running = self._running
        return running is not None and answer_complete(running) and not body_all_in(running)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.wire.is_closing():
            return
        if self._refusal is not None and not self._answering():
            self._send_refusal()
        elif self._unparsed:
            self._parse()

    def cut_off(self) -> None:
        """Close the connection now if an answer is being sent on it (the drain time has passed)."""
        running = self._running
        if running is not None and answer_started(running) and not answer_complete(running):
            self.wire.abort()

    # -- answers that are not read

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.event_loop.call_later(self.write_timeout_s, self._write_timed_out)

    def resume_writing(self) -> None:
        self._cancel_write_timer()
        super().resume_writing()

    def _cancel_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_timed_out(self) -> None:
        self._write_timer = None
        if not self.wire.is_closing():
            self.address_log.info(
                "write_timeout",
                self._peer,
                "closed a connection whose answer was not read for %g s (from %s)",
                self.write_timeout_s,
                self._peer,
            )
            # Reset, not closed: a close would leave the kernel holding what is unsent (megabytes) behind its FIN
            # for as long as the client does not read it.
            sock = self.wire.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.wire.abort()

    # -- parser callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes, self._head_raw = True, 0, 0
        self._chunks = self._body_bytes = 0
        self.stop_keep_alive_timer()  # after the rest of a body answered early, in the same read: the head timer runs
        if self._head_timer is None:  # the first request's runs from the connection's start
            self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self._grow(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:  # a field of a chunked body's trailer: bounded, then dropped
            self._trailers += 1
            self._head_bytes += len(name) + len(value) + 4
            if self._trailers > self.max_headers or self._head_bytes > self.max_header_bytes:
                limit = f"{self.max_headers} fields and {self.max_header_bytes} bytes"
                self._head_refusal = ServiceError(f"over the limit of {limit} with the headers", "trailers", status=431)
                raise _HeadRefused
            return
        self._grow(len(name) + len(value) + 4)  # with ": " and CRLF
        if len(self.head_fields) >= self.max_headers:
            limit = self.max_headers
            self._head_refusal = ServiceError(
                f"over {limit} of them; the limit is {limit} per request", "headers", status=431
            )
            raise _HeadRefused
        super().on_header(name, value)

    def on_chunk_header(self) -> None:
        self._chunks += 1
        if self._chunks > FREE_CHUNKS + self._body_bytes // CHUNK_BYTES:
            self._head_refusal = BadRequest(
                f"sent in over {FREE_CHUNKS} chunks averaging {self._body_bytes / (self._chunks - 1):.0f} bytes; "
                f"past {FREE_CHUNKS}, chunks must average at least {CHUNK_BYTES} bytes: send larger chunks",
                "body",
            )
            raise _HeadRefused

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        super().on_body(body)

    def on_headers_complete(self) -> None:
        if self.http_parser.should_upgrade() and self.upgrade_asked() == b"websocket":
            self._head_refusal = BadRequest("this server speaks no WebSocket; send plain HTTP/1.1 requests", "upgrade")
            raise _HeadRefused  # answered after the requests before it, as a bad head is
        version = self.http_parser.get_http_version()
        if version not in SPOKEN:
            message = f"HTTP/{version} is not spoken here: send HTTP/1.1"
            self._head_refusal = ServiceError(message, "request", status=505)
            raise _HeadRefused
        if refused := self.hosts.refusal(self.head_fields, version):
            self._head_refusal = refused
            raise _HeadRefused
        self._in_head = False
        self._trailers = len(self.head_fields)
        self._cancel_head_timer()
        super().on_headers_complete()

    def other_upgrade(self) -> None:
        # An upgrade other than WebSocket's (h2c): its request is answered as HTTP/1.1, which RFC 9110 allows, and
        # then the connection is closed, since httptools parses nothing after it. uvicorn logged two warnings per
        # request here.
        if self.current is not None and not answer_complete(self.current):
            close_after(self.current)
        elif not self._answering():
            self.wire.close()

    # -- bounds

    def _grow(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > self.max_header_bytes:
            self._head_refusal = self._too_large()
            raise _HeadRefused

    def _too_large(self) -> ServiceError:
        message = f"the request line and headers are over the limit of {self.max_header_bytes} bytes"
        return ServiceError(message, "headers", status=431)

    def _arm_head_timer(self) -> None:
        self._head_timer = self.event_loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.wire.is_closing():
            return
        if self._in_head:
            self._refuse(TooSlow(f"not all in within {self.head_timeout_s:g} s; send them at once", "headers"))
        elif not self._answering():
            self.wire.close()  # connected and sent nothing: there is no request to answer

    def _answering(self) -> bool:
        """Whether requests that came before are still being answered (pipelined ones included)."""
        return bool(self.waiting) or (self.current is not None and not answer_complete(self.current))

    def _refuse(self, refused: ServiceError) -> None:
        """Answer `refused` and close, after the answers to the requests before it (HTTP/1.1 answers in order)."""
        self._cancel_head_timer()
        self._unparsed.clear()
        self._refusal = http_answer(refused, self.server_headers)
        cycle = self.current
        if not self._in_head and cycle is self._running and cycle is not None and not answer_started(cycle):
            # The request being answered is the bad one (its body or trailer): it is answered now, not after the
            # body timeout, and its app sees the client gone.
            gone(cycle)
            self._send_refusal()
        elif not self._answering():
            self._send_refusal()

    def _send_refusal(self) -> None:
        self._unparsed.clear()
        self.wire.write(self._refusal)
        if not self.wire.can_write_eof():
            self.wire.close()
            return
        # Closing a socket with unread bytes resets the connection, and the client may lose the answer before it
        # reads it (a 1 MB header is still arriving): end the sending side, read and drop what still comes for
        # a moment, then close.
        self.wire.write_eof()
        self.event_loop.call_later(LINGER_S, self.wire.close)
