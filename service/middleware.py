"""ASGI middleware of the service: API keys, the body-size cap (before any parsing), per-route request metrics,
and the answer to requests cut off by the drain bound."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import Callable
from time import perf_counter, thread_time

import orjson

from service.metrics import Metrics


class ApiKeys:
    """With keys configured, every route but the health probes needs `Authorization: Bearer <key>`; 401
    otherwise, before the body is read. The key presented is compared with every configured key, all of them
    every time, in constant time on their SHA-256 digests: timing reveals neither a key, nor its length, nor
    which one matched."""

    OPEN = frozenset({"/health/live", "/health/ready"})

    def __init__(self, app, keys: list[str]):
        self.app = app
        self.digests = [hashlib.sha256(key.encode()).digest() for key in keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.digests:
            return await self.app(scope, receive, send)
        path, root = scope["path"], scope.get("root_path", "")
        if (path[len(root) :] if root and path.startswith(root) else path) in self.OPEN:
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or {}).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        presented = hashlib.sha256(token.strip()).digest()
        matched = False
        for digest in self.digests:
            matched |= hmac.compare_digest(presented, digest)
        if matched and scheme.lower() == b"bearer":
            return await self.app(scope, receive, send)
        detail = {"detail": "authorization: an API key is required (Authorization: Bearer <key>)"}
        challenge = b'Bearer error="invalid_token"' if header else b"Bearer"
        await send_json(send, 401, detail, [(b"www-authenticate", challenge)])


NEXT_PART_S = 0.05  # the least a body behind the minimum rate still gets for its next part


class BodyLimit:
    """Refuse a body over the limit with 413 before anything parses it (Content-Length or streamed), and bound
    what the bodies of all requests in flight hold together: over `inflight` bytes, 503 with Retry-After.

    A body must also keep arriving: each part within `timeout_s` of the last (the first within `timeout_s` of
    the headers), and all of it at `min_rate` bytes/s on average once `timeout_s` has passed. A slower one is
    answered 408 and its connection closed, and its bytes leave the in-flight budget at once: without this,
    ten clients that send most of a large body and then stop would hold the whole budget for as long as they
    keep their connections open, and every other POST would get 503."""

    def __init__(self, app, limit: int, inflight: int, retry_after_s: int, timeout_s: float, min_rate: int):
        self.app, self.limit, self.inflight = app, limit, inflight
        self.retry_after = str(retry_after_s).encode()
        self.timeout_s, self.min_rate = timeout_s, min_rate
        self.held = 0  # bytes of the bodies of all requests in flight

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or {}).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._too_large(send)
        chunks, size, more = [], 0, True
        start = perf_counter()
        try:
            while more:
                try:
                    message = await asyncio.wait_for(receive(), self._wait(start, size))
                except asyncio.TimeoutError:
                    return await self._too_slow(send, size, perf_counter() - start)
                if message["type"] != "http.request":
                    break  # the client went away; the app will see it
                chunk = message.get("body", b"")
                if size + len(chunk) > self.limit:
                    return await self._too_large(send)
                if self.held + len(chunk) > self.inflight:
                    detail = (
                        f"overloaded: request bodies in flight hold {self.held} of {self.inflight} bytes; retry later"
                    )
                    return await send_json(send, 503, {"detail": detail}, [(b"retry-after", self.retry_after)])
                chunks.append(chunk)
                size += len(chunk)
                self.held += len(chunk)
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
            self.held -= size

    def _wait(self, start: float, size: int) -> float:
        """How long the next part of a body may take: `timeout_s`, less whatever the body is behind the
        minimum rate (a client that sent 7 MiB fast earns no credit to stall on)."""
        if not self.min_rate:
            return self.timeout_s
        behind_rate = start + self.timeout_s + size / self.min_rate - perf_counter()
        # Never 0: wait_for(receive(), 0) times out without letting receive() hand over a part already waiting.
        return max(NEXT_PART_S, min(self.timeout_s, behind_rate))

    async def _too_slow(self, send, size: int, seconds: float):
        rate = f", at least {self.min_rate} bytes/s on average" if self.min_rate else ""
        detail = (
            f"body: too slow ({size} bytes in {seconds:.1f} s); a body must keep arriving (a part at least every "
            f"{self.timeout_s:g} s{rate})"
        )
        # The rest of the body is never read: the connection cannot carry another request, so it is closed.
        await send_json(send, 408, {"detail": detail}, [(b"connection", b"close")])

    async def _too_large(self, send):
        await send_json(send, 413, {"detail": f"body: larger than the limit of {self.limit} bytes"})


class DrainCutoff:
    """A request still running when the drain bound has passed is cancelled by uvicorn, which would answer
    it 500 and log a traceback: answer it 503 with Retry-After instead (another replica can take it)."""

    def __init__(self, app, draining: Callable[[], bool], retry_after_s: int):
        self.app, self.draining, self.retry_after = app, draining, str(retry_after_s).encode()

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
            if not self.draining() or started:
                raise
            task = asyncio.current_task()
            if task is not None and hasattr(task, "uncancel"):  # Python 3.11+: the cancellation is handled
                task.uncancel()
            detail = {"detail": "shutting down: the request did not finish within the drain time; retry"}
            await send_json(send, 503, detail, [(b"retry-after", self.retry_after)])


async def send_json(send, status: int, payload: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    """A whole JSON response, from ASGI middleware (below the routes' exception handlers)."""
    body = orjson.dumps(payload)
    length = str(len(body)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", length), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


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
