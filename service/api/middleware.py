"""ASGI middleware of the service: HEAD as GET, API keys, content codings refused, the body limit and budget
(before any parsing), the answer budget's release, per-route request metrics, and the answer to requests cut off by
the drain bound. The budgets themselves are service/admission.py's; this is where HTTP meets them."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from collections.abc import Callable
from time import perf_counter, thread_time

from service.admission import Hold, KeyedBudget
from service.api.errors import send_error
from service.api.paths import app_path
from service.errors import (
    BadRequest,
    ClientGone,
    NotReady,
    Overloaded,
    ServiceError,
    TooLarge,
    TooSlow,
    Unauthorized,
    UnsupportedEncoding,
    shown,
)
from service.metrics import Metrics

log = logging.getLogger("elmo.service")


class ApiKeys:
    """With keys configured, every route but the health probes needs `Authorization: Bearer <key>`; 401
    otherwise, before the body is read. The key presented is compared with every configured key, all of them
    every time, in constant time on their SHA-256 digests: timing reveals neither a key, nor its length, nor
    which one matched."""

    OPEN = frozenset({"/health/live", "/health/ready"})

    def __init__(self, app, keys: list[str]):
        self.app = app
        self.digests = [hashlib.sha256(key.encode()).digest() for key in keys]

    def refuses(self, scope) -> bool:
        """Whether this request will be answered 401 or 400 here (tracing makes no span for it)."""
        return self.verdict(scope) is not None

    def verdict(self, scope) -> ServiceError | None:
        """The refusal of this request (400: several Authorization headers; 401: no valid key), or None: let in."""
        if scope["type"] != "http" or not self.digests or app_path(scope) in self.OPEN:
            return None
        given = [value for name, value in scope.get("headers") or () if name == b"authorization"]
        if len(given) > 1:  # which one counts would be a guess (a proxy may read the first, this the last)
            return BadRequest(f"{len(given)} Authorization headers; send one", "authorization")
        header = given[0] if given else b""
        scheme, _, token = header.partition(b" ")
        presented = hashlib.sha256(token.strip()).digest()
        matched = False
        for digest in self.digests:
            matched |= hmac.compare_digest(presented, digest)
        if matched and scheme.lower() == b"bearer":
            return None
        challenge = b'Bearer error="invalid_token"' if header else b"Bearer"
        return Unauthorized(
            "an API key is required (Authorization: Bearer <key>)", "authorization",
            headers=[(b"www-authenticate", challenge)],
        )  # fmt: skip

    async def __call__(self, scope, receive, send):
        refused = self.verdict(scope)
        if refused is None:
            return await self.app(scope, receive, send)
        await send_error(scope, send, refused)


class HeadAsGet:
    """HEAD answered wherever GET is (RFC 9110 section 9.3.2): routed as GET, and uvicorn, which still sees HEAD in
    its own scope, sends the answer's headers without its body. FastAPI's routes answer the methods they name, so
    `HEAD /health/ready`, `/info` and `/metrics` were 405, and load balancers check health with HEAD. A route
    without GET (POST /embed) answers HEAD 405, with its Allow, as before. Counted and logged as GET."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "HEAD":
            scope = {**scope, "method": "GET"}
        await self.app(scope, receive, send)


class ContentEncodingRefused:
    """A body in a content coding is refused 415 before it is read (RFC 9110 section 15.5.16), with
    `Accept-Encoding: identity`: the service reads a body as sent, so gzip was a 422 ("UnicodeDecodeError") and
    `br` on a plain body was served as if no coding were named. Any coding, `identity` too (it is not one)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        codings = [value for name, value in scope.get("headers") or () if name == b"content-encoding"]
        if not codings:
            return await self.app(scope, receive, send)
        named = shown(b", ".join(codings).decode("latin-1"))
        refused = UnsupportedEncoding(
            f"{named!r}: bodies are read as sent; send it uncompressed, without Content-Encoding",
            "content-encoding",
            headers=[(b"accept-encoding", b"identity")],
        )
        await send_error(scope, send, refused)


NEXT_PART_S = 0.05  # the least a body behind the minimum rate still gets for its next part


class BodyLimit:
    """Refuse a body over the limit with 413 before anything parses it (Content-Length or streamed), and hold
    each part of it in the `budget` of the bodies in flight (service/admission.py: 503 with Retry-After over it,
    together or from one client address).

    A body must also keep arriving: each part within `timeout_s` of the last (the first within `timeout_s` of
    the headers), and all of it at `min_rate` bytes/s on average once `timeout_s` has passed. A slower one is
    answered 408 and its connection closed, and its bytes leave the in-flight budget at once: without this,
    ten clients that send most of a large body and then stop would hold the whole budget for as long as they
    keep their connections open, and every other POST would get 503."""

    def __init__(self, app, limit: int, budget: KeyedBudget, retry_after_s: int, timeout_s: float, min_rate: int):
        self.app, self.limit, self.budget, self.retry_after_s = app, limit, budget, retry_after_s
        self.timeout_s, self.min_rate = timeout_s, min_rate

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or {}).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._too_large(scope, send)
        chunks, size, more = [], 0, True
        start = perf_counter()
        client = client_address(scope)
        try:
            while more:
                try:
                    message = await asyncio.wait_for(receive(), self._wait(start, size))
                except asyncio.TimeoutError:
                    return await self._too_slow(scope, send, size, perf_counter() - start)
                if message["type"] != "http.request":  # the client left before its body was all sent: 499 (its
                    return await send_error(scope, send, ClientGone())  # partial body was parsed: 422)
                chunk = message.get("body", b"")
                if size + len(chunk) > self.limit:
                    return await self._too_large(scope, send)
                try:
                    self.budget.take(client, len(chunk))
                except Overloaded as refused:
                    return await send_error(scope, send, refused, self.retry_after_s)
                chunks.append(chunk)
                size += len(chunk)
                more = message.get("more_body", False)
            body, replayed = b"".join(chunks), False
            chunks.clear()

            async def replay():
                nonlocal replayed
                if not replayed:
                    replayed = True
                    # CPU time from here to the route is the body's parsing and validation (its `parse` stage)
                    scope.setdefault("state", {})["body_read_cpu"] = thread_time()
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            await self.app(scope, replay, send)
        finally:
            self.budget.give_back(client, size)

    def _wait(self, start: float, size: int) -> float:
        """How long the next part of a body may take: `timeout_s`, less whatever the body is behind the
        minimum rate (a client that sent 7 MiB fast earns no credit to stall on)."""
        if not self.min_rate:
            return self.timeout_s
        behind_rate = start + self.timeout_s + size / self.min_rate - perf_counter()
        # Never 0: wait_for(receive(), 0) times out without letting receive() hand over a part already waiting.
        return max(NEXT_PART_S, min(self.timeout_s, behind_rate))

    async def _too_slow(self, scope, send, size: int, seconds: float):
        rate = f", at least {self.min_rate} bytes/s on average" if self.min_rate else ""
        message = (
            f"too slow ({size} bytes in {seconds:.1f} s); a body must keep arriving (a part at least every "
            f"{self.timeout_s:g} s{rate})"
        )
        # The rest of the body is never read: the connection cannot carry another request, so it is closed.
        await send_error(scope, send, TooSlow(message, "body", headers=[(b"connection", b"close")]))

    async def _too_large(self, scope, send):
        await send_error(scope, send, TooLarge(f"larger than the limit of {self.limit} bytes", "body"))


ANSWER_HOLD = "elmo_answer_hold"  # the request's Hold on the answer budget, in its scope's state


def client_address(scope) -> str:
    """Whose request this is: the connection's address, or the client a trusted proxy names (the server's proxy
    headers middleware has put it in the scope; service/server/serve.py)."""
    return (scope.get("client") or ("",))[0]


def answer_hold(scope) -> Hold:
    """The request's Hold on the answer budget (AnswerRelease put it in its scope), for the embedder to take from."""
    return scope["state"][ANSWER_HOLD]


class AnswerRelease:
    """Around the routes and the sending: the request's hold on the answer budget (what the embedder takes for its
    answer, service/embedder.py) lasts until its answer is sent or its client has gone, and is given back then."""

    def __init__(self, app, budget: KeyedBudget):
        self.app, self.budget = app, budget

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        with self.budget.holding(client_address(scope)) as hold:
            scope.setdefault("state", {})[ANSWER_HOLD] = hold
            await self.app(scope, receive, send)


class DrainCutoff:
    """A request still running when the drain bound has passed is cancelled by uvicorn, which would answer
    it 500 and log a traceback: answer it 503 with Retry-After instead (another replica can take it). One whose
    answer had started (a slow reader) ends there, with a line in the log (DrainingServer closed its
    connection just before)."""

    def __init__(self, app, draining: Callable[[], bool], retry_after_s: int):
        self.app, self.draining, self.retry_after_s = app, draining, retry_after_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_started(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_started)
        except asyncio.CancelledError:
            if not self.draining():
                raise
            task = asyncio.current_task()
            if task is not None and hasattr(task, "uncancel"):  # Python 3.11+: the cancellation is handled
                task.uncancel()
            if started:  # an answer still being sent (a slow reader): the server closed its connection already
                log.info("the drain time passed while an answer was being sent: its connection was closed")
                return
            stopped = NotReady("shutting down: the request did not finish within the drain time; retry")
            await send_error(scope, send, stopped, self.retry_after_s)


class RequestMetrics:
    """Requests by route template and status, and their latency."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = perf_counter(), 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", "other")
            self.metrics.requests.labels(path, str(status)).inc()
            self.metrics.request_seconds.labels(path).observe(perf_counter() - start)
