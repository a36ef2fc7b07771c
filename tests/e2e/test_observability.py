"""What an operator follows a request by, on a real elmo-serve with API keys on: JSON log lines (every line of the
process, uvicorn's too), the request id given back and logged, an access line per request, no request text in the
log, and Prometheus scraping ELMO_METRICS_PORT without a key while the main port's /metrics keeps asking for one."""

from __future__ import annotations

import json
import time

import httpx
import pytest

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
    assert access["status"] == 401 and access["path"] == "/embed"


def test_prometheus_scrapes_the_metrics_port_without_a_key(server, client):
    assert client.get("/metrics").status_code == 401  # the main port's: behind the keys
    assert client.get("/metrics", headers=AUTH).status_code == 200
    scraped = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10)
    assert scraped.status_code == 200 and "elmo_requests_total" in scraped.text
    assert 'elmo_queue_tokens{model="' in scraped.text  # the gauges a scrape sets, set here too
    assert not [line for line in lines(server, "/metrics") if line.get("route") == "/metrics"]  # no access lines
