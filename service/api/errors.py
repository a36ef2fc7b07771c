"""Errors at the edge, answered once: a ServiceError (service/errors.py), raised by a route, a middleware or made of
a body that does not validate or of FastAPI's own HTTP errors, becomes its status and body here, in the service's
shape (`{"detail": ...}`), or under /v1/ in OpenAI's (`{"error": {...}}`, `param` the error's field), by
service/errors.py's two functions. OpenAI's clients pick their exception by OpenAI's status codes and read why from
its shape; a `{"detail": ...}` body would leave them with a bare "Error code: 422"."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from service.api.paths import app_path
from service.api.schemas import ErrorResponse, OpenAIEmbeddingRequest, OpenAIErrorResponse
from service.errors import (
    InvalidRequest,
    ServiceError,
    answer_headers,
    native_body,
    openai_body,
    openai_status,
    shown,
)

ERRORS = {code: {"model": ErrorResponse} for code in (401, 404, 413, 422, 503)}  # the OpenAPI document's
OPENAI_ERRORS = {code: {"model": OpenAIErrorResponse} for code in (400, 401, 404, 503)}  # /v1/*
MAX_ERRORS = 10  # a body with 100 000 wrong tokens is told about the first few, not in a 10 MB answer
PREFIX = "/v1/"
PARAMS = frozenset(OpenAIEmbeddingRequest.model_fields)  # the fields an OpenAI error's `param` may name


def error_answer(scope, err: ServiceError, retry_after_s: int | None) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The status, headers and body answering `err` to the request of `scope`: OpenAI's shape under /v1/."""
    if app_path(scope).startswith(PREFIX):
        status, body = openai_status(err), openai_body(err, PARAMS)
    else:
        status, body = err.status, native_body(err)
    return status, answer_headers(err, len(body), retry_after_s), body


async def send_error(scope, send, err: ServiceError, retry_after_s: int | None = None) -> None:
    """Answer `err` whole, from ASGI middleware (below the routes' exception handlers)."""
    status, headers, body = error_answer(scope, err, retry_after_s)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def error_response(request: Request, err: ServiceError, retry_after_s: int | None) -> Response:
    status, headers, body = error_answer(request.scope, err, retry_after_s)
    response = Response(body, status_code=status)
    response.raw_headers = headers
    return response


def install(app: FastAPI, retry_after_s: int) -> None:
    """The exception handlers: ServiceError, a body that does not validate, and FastAPI's own HTTP errors."""

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError):
        return error_response(request, exc, retry_after_s)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        return error_response(request, validation_error(request, exc), retry_after_s)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        # FastAPI answers 400 to a body that json.loads fails on other than with JSONDecodeError (bytes that are
        # not UTF-8, nesting deeper than the recursion limit): that too is an invalid body, so 422 like the rest.
        if exc.status_code == 400 and isinstance(exc.__cause__, (ValueError, RecursionError)):
            err = InvalidRequest(f"not valid JSON ({type(exc.__cause__).__name__})", "body")
            return error_response(request, err, retry_after_s)
        if exc.status_code < 400 or not isinstance(exc.detail, str):
            return await http_exception_handler(request, exc)
        headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (exc.headers or {}).items()]
        return error_response(request, ServiceError(exc.detail, status=exc.status_code, headers=headers), None)


def validation_error(request: Request, exc: RequestValidationError) -> InvalidRequest:
    """A body that does not validate: 422 naming the first field at fault, with the first MAX_ERRORS errors."""
    every = exc.errors()
    errors = [
        {"loc": [_cut(p) for p in e.get("loc", ())], "msg": e.get("msg", ""), "type": e.get("type", "")}
        for e in every[:MAX_ERRORS]
    ]
    extra = {"errors": errors, **({"more_errors": len(every) - MAX_ERRORS} if len(every) > MAX_ERRORS else {})}
    first = errors[0] if errors else {"loc": [], "msg": "invalid body"}
    if first.get("type") == "json_invalid":  # its loc is ("body", character offset): the field is the body
        reason = (every[0].get("ctx") or {}).get("error", "")
        return InvalidRequest(f"invalid JSON at character {first['loc'][-1]}: {reason}", "body", extra=extra)
    field = ".".join(str(p) for p in first["loc"] if p != "body") or "body"
    reason = _not_json(request) if field == "body" else None
    return InvalidRequest(reason or first["msg"], field, extra=extra)


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
