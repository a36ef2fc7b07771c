"""Tracing on a real elmo-serve, exported over OTLP/HTTP to a stand-in collector: spans carry no query values, long
paths or secrets and there is none for a refused request, trace context is followed from a trusted proxy only, and
the exit is bounded when the collector never answers."""

from __future__ import annotations

import threading
import time

import httpx

from tests.live_server import running_server


class Collector:
    """A stand-in OTLP/HTTP collector on 127.0.0.1: every span it is sent."""

    def __init__(self):
        import http.server

        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        spans = self.spans = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # http.server's name
                export = ExportTraceServiceRequest()
                export.ParseFromString(self.rfile.read(int(self.headers["content-length"])))
                spans.extend(s for r in export.resource_spans for scope in r.scope_spans for s in scope.spans)
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def wait_for(self, name: str) -> None:
        deadline = time.monotonic() + 15
        while not any(s.name == name for s in self.spans) and time.monotonic() < deadline:
            time.sleep(0.05)


def attributes(span) -> dict:
    return {a.key: a.value.string_value or a.value.int_value for a in span.attributes}


def test_spans_carry_no_query_values_nor_long_paths_and_none_for_a_refused_request(tiny_model_dir, tmp_path):
    collector = Collector()
    key, trace_id = "k-5", "4bf92f3577b34da6a3ce929d0e0e4736"
    settings = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "OTEL_METRICS_EXPORTER": "none",
                "OTEL_BSP_SCHEDULE_DELAY": "50", "ELMO_API_KEYS": key}  # fmt: skip
    auth, parent = {"authorization": f"Bearer {key}"}, {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
    try:
        with running_server(tiny_model_dir, tmp_path, settings) as server, httpx.Client(timeout=30) as c:
            long = f"{server.url}/x{'a' * 4_000}?text=Zanzibar&api_key=sk-live-123"
            assert c.get(long, headers=auth).status_code == 404
            refused = c.post(f"{server.url}/embed?refused=1", json={"sentences": ["A text ."]}, headers=parent)
            assert refused.status_code == 401
            answer = c.post(f"{server.url}/embed", json={"sentences": ["A text ."]}, headers={**auth, **parent})
            assert answer.status_code == 200
            collector.wait_for("elmo.encode")
    finally:
        collector.server.shutdown()
    servers = [attributes(s) for s in collector.spans if "url.path" in attributes(s)]
    assert len(servers) == 2, servers  # the 404 and the 200: none for the 401
    (unmatched,) = [a for a in servers if a["url.path"].startswith("/x")]
    assert len(unmatched["url.path"]) <= 103 and unmatched["url.query"] == "text=REDACTED&api_key=REDACTED"
    assert not [a for a in servers if "refused" in str(a.get("url.query"))]
    # From 127.0.0.1, not a trusted proxy here: the caller's traceparent is not followed
    assert not [s for s in collector.spans if s.trace_id.hex() == trace_id]


def test_traceparent_is_followed_from_a_trusted_proxy_only(tiny_model_dir, tmp_path):
    collector = Collector()
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    settings = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "OTEL_METRICS_EXPORTER": "none",
                "OTEL_BSP_SCHEDULE_DELAY": "50", "ELMO_FORWARDED_ALLOW_IPS": "127.0.0.1"}  # fmt: skip
    parent = {"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"}
    try:
        with running_server(tiny_model_dir, tmp_path, settings) as server:
            other = httpx.HTTPTransport(local_address="127.0.0.2")
            with httpx.Client(transport=other, timeout=30) as c:  # not a proxy: its trace context is dropped
                assert c.post(f"{server.url}/tokenize", json={"sentences": ["a"]}, headers=parent).status_code == 200
            with httpx.Client(timeout=30) as c:  # the trusted proxy's is followed
                assert c.post(f"{server.url}/embed", json={"sentences": ["a"]}, headers=parent).status_code == 200
            collector.wait_for("elmo.encode")
    finally:
        collector.server.shutdown()
    followed = {s.name for s in collector.spans if s.trace_id.hex() == trace_id}
    assert "POST /embed" in followed and "POST /tokenize" not in followed, followed


def test_the_exit_is_bounded_when_the_collector_never_answers(tiny_model_dir, tmp_path):
    import signal
    import socket

    hole = socket.socket()  # accepts connections (the kernel's backlog) and never answers
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)
    settings = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{hole.getsockname()[1]}",
                "OTEL_METRICS_EXPORTER": "none", "OTEL_BSP_SCHEDULE_DELAY": "50"}  # fmt: skip
    try:
        with running_server(tiny_model_dir, tmp_path, settings) as server, httpx.Client(timeout=30) as c:
            for _ in range(20):
                assert c.post(f"{server.url}/embed", json={"sentences": ["A text ."]}).status_code == 200
            time.sleep(0.5)
            start = time.perf_counter()
            server.proc.send_signal(signal.SIGTERM)
            server.proc.wait(timeout=120)
            took = time.perf_counter() - start
    finally:
        hole.close()
    from service.api.tracing import EXIT_EXPORT_S

    # Before: 41.9 s (four exports of 10 s each) with nothing in flight; the grace arithmetic counts EXIT_EXPORT_S.
    assert took < EXIT_EXPORT_S + 5, took
