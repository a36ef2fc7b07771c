"""What an operator follows a request by, on a real elmo-serve with API keys on: JSON log lines (every line of the
process, uvicorn's too), the request id given back and logged, an access line per request, no request text in the
log, and Prometheus scraping ELMO_METRICS_PORT without a key while the main port's /metrics keeps asking for one;
and traces exported over OTLP/HTTP by the standard variables alone, to a stand-in collector."""

from __future__ import annotations

import http.server
import json
import threading
import time

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.live_server import free_port, running_server

KEY = "k3y-observability-0123"
METRICS_PORT = free_port()
SETTINGS = {
    "ELMO_API_KEYS": KEY,
    "ELMO_LOG_FORMAT": "json",
    "ELMO_ACCESS_LOG": "true",
    "ELMO_METRICS_PORT": str(METRICS_PORT),
}
AUTH = {"authorization": f"Bearer {KEY}"}
SECRET = "Zanzibarian"  # a word of a request's text, which must never reach the log


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("observability"), SETTINGS) as s:
        yield s


def lines(server, until: str) -> list[dict]:
    """The log so far as JSON objects, once a line with `until` in it is there (the access line comes last)."""
    deadline = time.monotonic() + 10
    while True:
        text = server.log.read_text()
        if until in text or time.monotonic() > deadline:
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        time.sleep(0.05)


def test_a_request_is_followed_by_its_id_through_the_answer_and_the_log(server, client):
    body = {"sentences": [f"The {SECRET} bank of the river ."], "pooling": "mean"}
    answer = client.post("/embed", json=body, headers={**AUTH, "x-request-id": "op-trace-42"})
    assert answer.status_code == 200 and answer.headers["x-request-id"] == "op-trace-42"
    logged = lines(server, "op-trace-42")
    for line in logged:  # every line of the process is one JSON object with these
        assert {"time", "level", "logger", "message"} <= set(line), line
    assert any(line["logger"].startswith("uvicorn") for line in logged)
    (access,) = [line for line in logged if line.get("request_id") == "op-trace-42"]
    assert access["logger"] == "elmo.access" and access["route"] == "/embed" and access["status"] == 200
    assert access["model"] == client.get("/info", headers=AUTH).json()["model"]
    assert access["sentences"] == 1 and access["tokens"] == 7 and access["duration_ms"] > 0
    assert SECRET not in server.log.read_text()


def test_an_error_names_its_request_id_in_the_body_the_header_and_the_log(server, client):
    refused = client.post("/embed", json={"sentences": [["a"]]}, headers={"x-request-id": "bad id with spaces"})
    assert refused.status_code == 401
    rid = refused.headers["x-request-id"]
    assert rid != "bad id with spaces" and refused.json()["request_id"] == rid  # not sane: replaced
    (access,) = [line for line in lines(server, rid) if line.get("request_id") == rid]
    assert access["status"] == 401 and access["route"] == "/embed"  # refused before routing: its template still


def test_prometheus_scrapes_the_metrics_port_without_a_key(server, client):
    assert client.get("/metrics").status_code == 401  # the main port's: behind the keys
    assert client.get("/metrics", headers=AUTH).status_code == 200
    scraped = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10)
    assert scraped.status_code == 200 and "elmo_requests_total" in scraped.text
    assert 'elmo_queue_tokens{model="' in scraped.text  # the gauges a scrape sets, set here too
    assert not [line for line in lines(server, "/metrics") if line.get("route") == "/metrics"]  # no access lines


SPANS: list = []  # (service name, span) of every span the stand-in collector was sent


class Collector(http.server.BaseHTTPRequestHandler):
    """A stand-in OTLP/HTTP collector: keeps every span it is sent in SPANS."""

    def do_POST(self):  # http.server's name
        body = self.rfile.read(int(self.headers["content-length"]))
        if self.path == "/v1/traces":
            export = ExportTraceServiceRequest()
            export.ParseFromString(body)
            for resource in export.resource_spans:
                service = {a.key: a.value.string_value for a in resource.resource.attributes}["service.name"]
                SPANS.extend([(service, s) for scope in resource.scope_spans for s in scope.spans])
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_the_standard_otel_variables_alone_export_a_request_s_trace(tiny_model_dir, tmp_path):
    collector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}"
    settings = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "ELMO_FORWARDED_ALLOW_IPS": "127.0.0.1",  # a caller's trace context is followed from a trusted proxy only
    }
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    try:
        with running_server(tiny_model_dir, tmp_path, settings) as server:
            parent = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}  # the caller's trace, continued
            answer = httpx.post(f"{server.url}/embed", json={"sentences": ["A text ."]}, headers=parent, timeout=30)
            assert answer.status_code == 200
            assert httpx.get(f"{server.url}/health/ready", timeout=30).status_code == 200
            deadline = time.monotonic() + 10
            while not any(s.name == "elmo.encode" for _, s in SPANS) and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        collector.shutdown()
    ours = {s.name: (service, s) for service, s in SPANS if s.trace_id.hex() == trace_id}
    assert {"POST /embed", "elmo.tokenize", "elmo.queue", "elmo.inference", "elmo.encode"} <= set(ours), ours.keys()
    assert {service for service, _ in ours.values()} == {"elmo-service"}  # OTEL_SERVICE_NAME's default
    assert not [s for _, s in SPANS if "health" in s.name]
