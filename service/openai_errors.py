"""OpenAI's error answers on the OpenAI-style routes (/v1/*). OpenAI's clients read why a request failed from
`{"error": {"message", "type", "param", "code"}}` (the `openai` package puts `message` in its exception's text, and
`type`, `param` and `code` on it) and pick their exception by OpenAI's status codes; a `{"detail": ...}` body leaves
them with a bare "Error code: 422". So every error answer under /v1/ is rewritten here, whoever made it (a route,
the validation of a body, the API keys, the body limit): its status as OpenAI would answer, its `detail`, the same
message /embed gives for the same mistake, as `message`, and the field that message starts with as `param`."""

from __future__ import annotations

import re

import orjson

from service.schemas import OpenAIEmbeddingRequest

PREFIX = "/v1/"
# OpenAI answers a request it will not serve, whether malformed or too large, with 400 invalid_request_error.
STATUS = {413: 400, 422: 400}
# Where a `detail` starts with one of these, the field at fault is its `param`, with the item's index if it names one
# ("input[3]: empty sentence"), without the type of a union's member ("input.str: Input should be a valid string").
FIELDS = frozenset(OpenAIEmbeddingRequest.model_fields)
FIELD = re.compile(r"([A-Za-z_]\w*)(\[\d+\])?(?=[:.\[])")


def openai_error(status: int, detail: str) -> tuple[int, dict]:
    """The status and body OpenAI would answer for the service's `status` and `detail`."""
    status = STATUS.get(status, status)
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
