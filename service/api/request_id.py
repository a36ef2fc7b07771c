"""Every request gets an id, and every answer gives it back: `X-Request-Id` on the answer (the caller's own, if it
sent a sane one, else a new one), `request_id` in an error's JSON body, and on every log line written while the
request is handled (service/logs.py), with an access line at its end when ELMO_ACCESS_LOG is on (but for the
probes and /metrics).

The outermost middleware, so that every answer carries the id: the routes', the errors of the middleware below it
(401, 408, 413, 503) and FastAPI's own (404, 405). An answer the HTTP protocol gives before a request reaches the
app (431, or 408 for a head too slow) has none."""

from __future__ import annotations

import logging
import re
import uuid
from time import perf_counter

import orjson

from service.api.tracing import PROBES
from service.logs import CURRENT, RequestLog, current

HEADER = b"x-request-id"
# A caller's id is kept if it is one header of 1-128 characters of these (UUIDs, hex, base64, W3C trace ids, most
# proxies' and load balancers' ids); anything else is replaced, so that a log line or a header never carries what
# a client chose to put there.
SANE = re.compile(rb"[A-Za-z0-9._:/+=@-]{1,128}")
access_log = logging.getLogger("elmo.access")


def new_id() -> str:
    return uuid.uuid4().hex


def request_id(given: list[bytes]) -> str:
    """The caller's id if it sent one sane X-Request-Id, else a new one."""
    if len(given) == 1 and SANE.fullmatch(given[0]):
        return given[0].decode("ascii")
    return new_id()


def note(**known) -> None:
    """What a route learned of its request (the model it names, its sentences and tokens), for its log lines."""
    request = current()
    if request is not None:
        for name, value in known.items():
            setattr(request, name, value)


class RequestId:
    def __init__(self, app, access_log: bool = False):
        self.app, self.access_log = app, access_log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = request_id([value for name, value in scope.get("headers") or () if name == HEADER])
        request = RequestLog(rid, scope.get("method", ""), scope)
        scope.setdefault("state", {})["request_id"] = rid
        token = CURRENT.set(request)
        start, status, held, parts = perf_counter(), None, None, []
        header = (HEADER, rid.encode("ascii"))

        async def send_with_id(message):
            nonlocal status, held
            kind = message["type"]
            if kind == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), header]}
                if status >= 400 and _json(message):
                    held = message  # an error's JSON body is small: held whole, to put the id in it
                    return None
                return await send(message)
            if held is None or kind != "http.response.body":
                return await send(message)
            parts.append(message.get("body", b""))
            if message.get("more_body", False):
                return None
            body = _with_id(b"".join(parts), rid)
            headers = [(k, v) for k, v in held["headers"] if k.lower() != b"content-length"]
            await send({**held, "headers": [*headers, (b"content-length", b"%d" % len(body))]})
            await send({"type": "http.response.body", "body": body})

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            CURRENT.reset(token)
            if self.access_log and scope.get("path") not in PROBES:
                self._log(request, status, perf_counter() - start)

    @staticmethod
    def _log(request: RequestLog, status: int | None, seconds: float) -> None:
        fields = {"status": status, "duration_ms": round(seconds * 1000, 3)}
        client = request.scope.get("client")
        if client:
            fields["client"] = client[0]
        fields.update({k: v for k, v in request.fields().items() if k in ("model", "sentences", "tokens")})
        access_log.info("%s %s", request.method, request.route, extra={"request": request.fields(), "fields": fields})


def _json(start: dict) -> bool:
    for name, value in start.get("headers", ()):
        if name.lower() == b"content-type":
            return value.split(b";")[0].strip().lower() == b"application/json"
    return False


def _with_id(body: bytes, rid: str) -> bytes:
    """An error's JSON body (`{"detail": ...}`, or OpenAI's `{"error": ...}`) with `request_id` beside its other
    keys; any other body is left as it is (a draining /health/ready's `{"status": "draining"}`)."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    if not isinstance(payload, dict) or not ({"detail", "error"} & payload.keys()):
        return body
    return orjson.dumps({**payload, "request_id": rid})
