"""The metrics port's ASGI app (service/server/metrics_port.py) without a server, on a real registry: what it answers
where it does not serve (404, 405, 503) is the service's one error shape with its headers (service/errors.py), and
HEAD is answered wherever GET is, with GET's status and headers and no body. tests/e2e/test_metrics_port.py runs it
on a real elmo-serve."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import orjson
import pytest

from service.errors import Overloaded, ServiceError, native_body
from service.metrics import Metrics
from service.server.metrics_port import PATH, MetricsApp, Pace


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def metrics_app(pace: Pace | None = None) -> MetricsApp:
    app = SimpleNamespace(state=SimpleNamespace(runtime=SimpleNamespace(metrics=Metrics()), models=[]))
    return MetricsApp(app, pace=pace)


def call(app: MetricsApp, method: str, path: str = PATH, headers: list | None = None) -> tuple[int, dict, bytes]:
    """The status, headers and body `app` answers to one request."""
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": headers or []}
    asyncio.run(app(scope, receive, send))
    start, body = sent
    assert body["type"] == "http.response.body" and len(sent) == 2
    return start["status"], dict(start["headers"]), body["body"]


@pytest.mark.parametrize(
    "method, path, err",
    [
        ("GET", "/health/live", ServiceError(f"not found: this port serves {PATH} alone", status=404)),
        ("GET", "/metrics/x", ServiceError(f"not found: this port serves {PATH} alone", status=404)),
        ("POST", PATH, ServiceError(f"{PATH} answers GET", status=405)),
        ("DELETE", PATH, ServiceError(f"{PATH} answers GET", status=405)),
    ],
)
def test_what_it_does_not_serve_is_answered_as_a_service_error(method, path, err):
    status, headers, body = call(metrics_app(), method, path)
    assert status == err.status and body == native_body(err)
    assert orjson.loads(body) == {"detail": str(err)}
    assert headers[b"content-type"] == b"application/json" and headers[b"content-length"] == b"%d" % len(body)
    assert (headers.get(b"allow") == b"GET, HEAD") == (status == 405)


def test_a_scrape_over_the_pace_is_a_503_with_retry_after():
    clock = Clock()
    app = metrics_app(Pace(rate_per_s=1.0, max_wait_s=0.0, clock=clock))
    assert call(app, "GET")[0] == 200
    status, headers, body = call(app, "GET")  # the next slot is a second away, and none may wait
    assert status == 503 and headers[b"retry-after"] == b"1"
    assert body == native_body(Overloaded("over 10 scrapes a second; retry later"))
    clock.now = 1.0
    assert call(app, "GET")[0] == 200  # its slot has come


@pytest.mark.parametrize("path", [PATH, "/nothing"])
def test_head_is_answered_wherever_get_is_with_its_headers_and_no_body(path):
    app = metrics_app()
    get_status, get_headers, get_body = call(app, "GET", path)
    head_status, head_headers, head_body = call(app, "HEAD", path)
    assert head_status == get_status == (200 if path == PATH else 404)
    assert head_headers == get_headers and int(head_headers[b"content-length"]) == len(get_body) > 0
    assert head_body == b""


def test_head_over_the_pace_is_a_503_without_a_body():
    app = metrics_app(Pace(rate_per_s=1.0, max_wait_s=0.0, clock=Clock()))
    status, _, body = call(app, "HEAD")
    assert status == 200 and body == b""
    status, headers, body = call(app, "HEAD")
    assert status == 503 and headers[b"retry-after"] == b"1" and int(headers[b"content-length"]) > 0 and body == b""


def test_a_scrape_reads_the_registry_in_the_format_asked_and_gzipped():
    status, headers, body = call(metrics_app(), "GET")
    assert status == 200 and headers[b"content-type"].startswith(b"text/plain") and b"elmo_requests_total" in body
    status, headers, body = call(
        metrics_app(), "GET", headers=[(b"accept", b"application/openmetrics-text; version=1.0.0"),
                                       (b"accept-encoding", b"gzip")]
    )  # fmt: skip
    assert headers[b"content-type"].startswith(b"application/openmetrics-text")
    assert headers[b"content-encoding"] == b"gzip" and body[:2] == b"\x1f\x8b"
