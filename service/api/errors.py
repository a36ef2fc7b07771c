"""Errors at the edge, mapped once: a ServiceError (service/errors.py) becomes its status and `{"detail": ...}`;
a body that does not validate becomes 422 naming the field; and under /v1/, every error answer, whoever made it,
becomes OpenAI's shape.

OpenAI's clients read why a request failed from `{"error": {"message", "type", "param", "code"}}` (the `openai`
package puts `message` in its exception's text, and `type`, `param` and `code` on it) and pick their exception by
OpenAI's status codes; a `{"detail": ...}` body leaves them with a bare "Error code: 422". So every error answer
under /v1/ is rewritten here (a route's, the validation of a body, the API keys, the body limit): its status as
OpenAI would answer, its `detail`, the same message /embed gives for the same mistake, as `message`, and the field
that message starts with as `param`."""

from __future__ import annotations

import re

import orjson
from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.api.answers import json_response
from service.api.schemas import ErrorResponse, OpenAIEmbeddingRequest, OpenAIErrorResponse
from service.errors import (
    ClientGone,
    EngineFailed,
    InvalidRequest,
    NotReady,
    Overloaded,
    ServiceError,
    TooLarge,
    UnknownModel,
    shown,
)

# Each kind of ServiceError's status; 503s carry Retry-After. 499: nginx's "client closed request" (never sent: the
# client has gone; the metrics count it).
STATUS = {
    InvalidRequest: 422,
    TooLarge: 413,
    UnknownModel: 404,
    ClientGone: 499,
    Overloaded: 503,
    NotReady: 503,
    EngineFailed: 503,
}
ERRORS = {code: {"model": ErrorResponse} for code in (401, 404, 413, 422, 503)}  # the OpenAPI document's
OPENAI_ERRORS = {code: {"model": OpenAIErrorResponse} for code in (400, 401, 404, 503)}  # /v1/*
MAX_ERRORS = 10  # a body with 100 000 wrong tokens is told about the first few, not in a 10 MB answer


def status_of(err: ServiceError) -> int:
    return next(status for kind, status in STATUS.items() if isinstance(err, kind))


def install(app: FastAPI, retry_after_s: int) -> None:
    """The exception handlers: ServiceError, a body that does not validate, and FastAPI's own HTTP errors."""
    retry = {"Retry-After": str(retry_after_s)}

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError):
        status = status_of(exc)
        return json_response({"detail": exc.detail}, status, retry if status == 503 else None)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        every = exc.errors()
        errors = [
            {"loc": [_cut(p) for p in e.get("loc", ())], "msg": e.get("msg", ""), "type": e.get("type", "")}
            for e in every[:MAX_ERRORS]
        ]
        more = {"more_errors": len(every) - MAX_ERRORS} if len(every) > MAX_ERRORS else {}
        first = errors[0] if errors else {"loc": [], "msg": "invalid body"}
        if first.get("type") == "json_invalid":  # its loc is ("body", character offset): the field is the body
            reason = (every[0].get("ctx") or {}).get("error", "")
            detail = f"body: invalid JSON at character {first['loc'][-1]}: {reason}"
            return json_response({"detail": detail, "errors": errors, **more}, status=422)
        field = ".".join(str(p) for p in first["loc"] if p != "body") or "body"
        reason = _not_json(request) if field == "body" else None
        return json_response({"detail": f"{field}: {reason or first['msg']}", "errors": errors, **more}, status=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        # FastAPI answers 400 to a body that json.loads fails on other than with JSONDecodeError (bytes that are
        # not UTF-8, nesting deeper than the recursion limit): that too is an invalid body, so 422 like the rest.
        if exc.status_code == 400 and isinstance(exc.__cause__, (ValueError, RecursionError)):
            return json_response({"detail": f"body: not valid JSON ({type(exc.__cause__).__name__})"}, status=422)
        return await http_exception_handler(request, exc)


def _not_json(request: Request) -> str | None:
    """Why a body is not read as JSON, if its Content-Type says another type (curl -d sends a form's type): FastAPI
    then validates its bytes, and its message ("Input should be a valid dictionary") would not say why."""
    declared = request.headers.get("content-type")
    kind = (declared or "").split(";")[0].strip().lower()
    if declared is None or kind == "application/json" or kind.endswith("+json"):
        return None
    return (
        f"sent as {kind or 'an empty Content-Type'}, not JSON: send the header Content-Type: application/json "
        "(curl: -H 'content-type: application/json')"
    )


def _cut(part: str | int) -> str | int:
    return shown(part) if isinstance(part, str) else part  # an unknown field's name may be a megabyte long


# -- OpenAI's shape under /v1/

PREFIX = "/v1/"
# OpenAI answers a request it will not serve, whether malformed or too large, with 400 invalid_request_error.
OPENAI_STATUS = {413: 400, 422: 400}
# Where a `detail` starts with one of these, the field at fault is its `param`, with the item's index if it names one
# ("input[3]: empty sentence"), without the type of a union's member ("input.str: Input should be a valid string").
FIELDS = frozenset(OpenAIEmbeddingRequest.model_fields)
FIELD = re.compile(r"([A-Za-z_]\w*)(\[\d+\])?(?=[:.\[])")


def openai_error(status: int, detail: str) -> tuple[int, dict]:
    """The status and body OpenAI would answer for the service's `status` and `detail`."""
    status = OPENAI_STATUS.get(status, status)
    found = FIELD.match(detail)
    param = found[1] + (found[2] or "") if found and found[1] in FIELDS and status < 500 else None
    code = None
    if status == 401:
        code = "invalid_api_key"
    elif status == 404 and param == "model":
        code = "model_not_found"
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return status, {"error": {"message": detail, "type": kind, "param": param, "code": code}}


class OpenAIErrors:
    """ASGI middleware: under /v1/, an error answer `{"detail": "..."}` becomes OpenAI's `{"error": {...}}` (its
    headers, Retry-After and WWW-Authenticate among them, kept); every other answer passes as it is."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not _path(scope).startswith(PREFIX):
            return await self.app(scope, receive, send)
        start: dict | None = None
        parts: list[bytes] = []

        async def reshape(message):
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until the body is whole: an error's body is small
                return None
            if start is None or message["type"] != "http.response.body":
                return await send(message)
            parts.append(message.get("body", b""))
            if message.get("more_body", False):
                return None
            status, body = _reshaped(start["status"], b"".join(parts))
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            await send({**start, "status": status, "headers": [*headers, (b"content-length", b"%d" % len(body))]})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, reshape)


def _reshaped(status: int, body: bytes) -> tuple[int, bytes]:
    try:
        detail = orjson.loads(body).get("detail")
    except (orjson.JSONDecodeError, AttributeError):
        detail = None
    if not isinstance(detail, str):  # not one of the service's error answers: left as it is
        return status, body
    status, error = openai_error(status, detail)
    return status, orjson.dumps(error)


def _path(scope) -> str:
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path
