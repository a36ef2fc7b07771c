"""Why the service does not serve a request: one error type, raised anywhere (admission, the model registry,
batching, the middleware, the HTTP protocol), carrying its status, its message, the field at fault, its Retry-After
and any header of its own; and the two functions that turn it into bytes: `native_body` (`{"detail": ...}`) and
`openai_body` (OpenAI's `{"error": {...}}`, for /v1/). The message says what is wrong and names the field at fault.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from http import HTTPStatus

import orjson

MAX_NAME_SHOWN = 64  # characters of a name a client sent, echoed back: it may have sent a megabyte of it


def shown(name: str) -> str:
    """A name a client sent, cut to MAX_NAME_SHOWN characters for an answer."""
    return name[:MAX_NAME_SHOWN] + "..." if len(name) > MAX_NAME_SHOWN else name


Headers = Sequence[tuple[bytes, bytes]]


class ServiceError(Exception):
    """A request refused: its `status` (each kind below has its own), why, the field of the request it concerns
    (`sentences[3]`), if one, its Retry-After in seconds (a 503 without one gets the server's ELMO_RETRY_AFTER_S at
    the edge), headers of its own (`WWW-Authenticate`, `Connection: close`), and `extra` keys for the native body
    (a validation error's list of errors)."""

    status = 500

    def __init__(
        self,
        message: str,
        field: str | None = None,
        *,
        status: int | None = None,
        retry_after: int | None = None,
        headers: Headers = (),
        extra: dict | None = None,
    ):
        super().__init__(message)
        self.field = field
        if status is not None:
            self.status = status
        self.retry_after, self.headers, self.extra = retry_after, list(headers), extra or {}

    @property
    def detail(self) -> str:
        """What the client reads: the field first, as every error of the API says it."""
        return f"{self.field}: {self}" if self.field else str(self)


class BadRequest(ServiceError):
    """The request cannot be read as one request (two Authorization headers, not HTTP/1.1): 400."""

    status = 400


class Unauthorized(ServiceError):
    """No valid API key: 401, with its WWW-Authenticate challenge."""

    status = 401


class UnknownModel(ServiceError):
    """The request named a model this server does not serve: 404."""

    status = 404

    def __init__(self, name: str, known: list[str]):
        super().__init__(f"unknown model {shown(name)!r}; this server serves: {', '.join(known)}", "model")


class TooSlow(ServiceError):
    """The request's head or body did not arrive in time: 408, and its connection closed."""

    status = 408


class TooLarge(ServiceError):
    """The request is over a limit it can never fit under; retrying is no use: 413."""

    status = 413


class UnsupportedEncoding(ServiceError):
    """The body comes in a content coding (gzip, br): bodies are read as sent, so it is refused: 415."""

    status = 415


class InvalidRequest(ServiceError):
    """The request is malformed for this model (a field out of range, an empty sentence): 422."""

    status = 422


class ClientGone(ServiceError):
    """The client closed the request before it was answered: the work for it stopped (499 in the metrics: nginx's
    "client closed request", never sent, the client has gone)."""

    status = 499

    def __init__(self) -> None:
        super().__init__("client closed the request")


class Overloaded(ServiceError):
    """A budget or queue is full now; the same request may be served later: 503 with Retry-After."""

    status = 503


class NotReady(ServiceError):
    """The server is starting or stopping: 503 with Retry-After."""

    status = 503


class EngineFailed(ServiceError):
    """The engine failed on this request's own sentences (out of memory, say): 503, retry."""

    status = 503


def native_body(err: ServiceError) -> bytes:
    """The service's own shape: `{"detail": "<field>: <message>"}`, and the error's extra keys."""
    return orjson.dumps({"detail": err.detail, **err.extra})


# OpenAI answers a request it will not serve, whether malformed or too large, with 400 invalid_request_error.
OPENAI_STATUS = {413: 400, 422: 400}
PARAM = re.compile(r"([A-Za-z_]\w*)(?:\[(\d+)\]|\.(\d+))?")


def openai_status(err: ServiceError) -> int:
    return OPENAI_STATUS.get(err.status, err.status)


def openai_body(err: ServiceError, params: Collection[str] = ()) -> bytes:
    """OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, which OpenAI's clients read (the `openai`
    package puts `message` in its exception's text, and `type`, `param` and `code` on it): `param` is the error's
    field where it names one of the request's `params` (`input[2]`; `input` for `input.str`, a union member), and
    the status is `openai_status`'s."""
    status = openai_status(err)
    found = PARAM.match(err.field or "")
    param = None
    if found and found[1] in params and status < 500:
        index = found[2] or found[3]
        param = found[1] + (f"[{index}]" if index else "")
    code = None
    if status == 401:
        code = "invalid_api_key"
    elif status == 404 and param == "model":
        code = "model_not_found"
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return orjson.dumps({"error": {"message": err.detail, "type": kind, "param": param, "code": code}})


def answer_headers(err: ServiceError, length: int, retry_after_s: int | None = None) -> list[tuple[bytes, bytes]]:
    """An error answer's headers: JSON of `length` bytes, Retry-After on a 503 (the error's own, else
    `retry_after_s`), and the error's own headers."""
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % length)]
    retry = err.retry_after if err.retry_after is not None else retry_after_s
    if err.status == 503 and retry is not None:
        headers.append((b"retry-after", b"%d" % retry))
    return headers + err.headers


def http_answer(err: ServiceError, more_headers: Headers = ()) -> bytes:
    """The whole HTTP/1.1 answer to `err` in the native shape, closing the connection: for the HTTP protocol,
    which answers before a request reaches the app."""
    body = native_body(err)
    head = [b"HTTP/1.1 %d %s\r\n" % (err.status, HTTPStatus(err.status).phrase.encode())]
    head += [name + b": " + value + b"\r\n" for name, value in [*more_headers, *answer_headers(err, len(body))]]
    return b"".join([*head, b"connection: close\r\n\r\n", body])
