"""The process's logs: one format for every logger (the service's, uvicorn's, ONNX Runtime's Python side), text for
a terminal or one JSON object a line for a log collector (ELMO_LOG_FORMAT=json), and what each line knows of the
request it was written for (its request id, route, model and token counts: service/api/request_id.py sets them).

A JSON line holds `time` (UTC, ISO 8601, milliseconds), `level`, `logger` and `message`; within a request,
`request_id`, `method` and `route` (the route template, also for a request refused before routing reached it, or
`other` where none matches: never the path, which a client chooses, as the metrics do), and
what the request has come to know (`model`, `sentences`, `tokens`); an access line adds `status`, `duration_ms`
and `client`; a failure its `exception`. No request text is ever among them: the one line that carries it is
ELMO_LOG_REQUEST_TEXT's, off by default."""

from __future__ import annotations

import logging
import re
import sys
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

import orjson

TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# What a text line must never carry raw: control characters (CR and LF start a forged line, ESC sequences erase the
# real one on a terminal), C1 controls and Unicode's line and paragraph separators.
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escaped(text: str) -> str:
    """`text` with every control character written as \\xNN (\\uNNNN above 0xff): one line, inert on a terminal."""
    return CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", text)


def route_template(scope: dict) -> str:
    """The template of the route a request is for, by the app's routes (a request refused before routing, a 401,
    still names it), or `other`: never the path itself."""
    route = scope.get("route")
    if route is not None:
        return getattr(route, "path", "other")
    return _template(getattr(getattr(scope.get("app"), "router", None), "routes", ()), scope) or "other"


def _template(routes, scope: dict) -> str | None:
    for candidate in routes:
        included = getattr(candidate, "original_router", None)  # FastAPI's include_router (no prefix here)
        if included is not None:
            if found := _template(included.routes, scope):
                return found
            continue
        try:
            match, _ = candidate.matches(scope)
        except Exception:  # a scope a route cannot read (not HTTP): no template
            continue
        if match.value and hasattr(candidate, "path"):  # FULL, or PARTIAL (another method): the route's template
            return candidate.path
    return None


@dataclass
class RequestLog:
    """What the log lines of one request say of it: set when it arrives, filled in as it goes (the model it named,
    its counts), read by every line written while it is handled and by its access line."""

    request_id: str
    method: str
    scope: dict = field(repr=False)  # the ASGI scope: the route template once routing has matched it
    model: str | None = None
    sentences: int | None = None
    tokens: int | None = None

    @property
    def route(self) -> str:
        return route_template(self.scope)

    def fields(self) -> dict:
        found = {"request_id": self.request_id, "method": self.method, "route": self.route}
        for name in ("model", "sentences", "tokens"):
            if (value := getattr(self, name)) is not None:
                found[name] = value
        return found


# The request being handled by this task (each request runs in a task of its own; threads see none).
CURRENT: ContextVar[RequestLog | None] = ContextVar("elmo_request_log", default=None)


def current() -> RequestLog | None:
    return CURRENT.get()


class RequestFields(logging.Filter):
    """Puts the current request's fields on every record written while it is handled (`record.request`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request"):
            request = CURRENT.get()
            record.request = request.fields() if request is not None else None
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, the request's fields, the line's own `fields` (an
    access line's status and duration), and the exception's traceback if there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update(getattr(record, "request", None) or {})
        line.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(line, default=str).decode()


class TextFormatter(logging.Formatter):
    """The text lines as before, with the request id (and an access line's fields) at the end."""

    def __init__(self) -> None:
        super().__init__(TEXT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escaped(record.message)  # a client's text (a method, a name) can never start a line
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        request = getattr(record, "request", None)
        fields = getattr(record, "fields", None)
        if fields:
            text += " " + " ".join(f"{k}={escaped(str(v))}" for k, v in fields.items())
        if request:
            text += f" [{request['request_id']}]"
        return text


def configure(level: str, fmt: str) -> None:
    """Every logger of the process to stderr in `fmt` ("text" or "json") from `level` up: one handler on the root,
    which uvicorn's loggers reach too when uvicorn is given no logging configuration of its own (JSON)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(RequestFields())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
