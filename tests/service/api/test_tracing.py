"""Tracing through FastAPI's own OpenTelemetry support, with the SDK's in-memory exporter: a request's server span
and its steps as children (tokenize, queue, inference, encode) with the model and the counts and never the text;
no spans for the probes; nothing at all, and the service still serving, without a configured provider or SDK."""

from __future__ import annotations

import logging
import os

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.testclient import TestClient

from service.api import tracing
from service.api.app import create_app
from service.settings import Settings

STEPS = ["elmo.tokenize", "elmo.queue", "elmo.inference", "elmo.encode"]


@pytest.fixture
def settings(tiny_model_dir) -> Settings:
    return Settings(model_dir=tiny_model_dir, provider="cpu", intra_op_threads=1, inter_op_threads=1)


class _TestProvider(TracerProvider):
    """An SDK tracer provider whose fork hook is off once its test is done. A provider registers a hook that runs in
    every forked child of the process (it detects the child's resources on threads of its own), and lives on (its
    exit hook, FastAPI's app state): one of these tests' ran in the bulk writer's forked process of a later test,
    and hung it there (a thread started in the child never ran)."""

    done = False

    def _handle_fork(self) -> None:
        if not self.done:
            super()._handle_fork()


@pytest.fixture
def provider():
    provider = _TestProvider()
    yield provider
    provider.done = True
    provider.shutdown()


def test_a_request_s_steps_are_children_of_its_server_span(settings, provider):
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with TestClient(create_app(settings, tracer_provider=provider)) as client:
        assert client.get("/health/ready").status_code == 200
        exporter.clear()  # the warm-up's, if any
        answer = client.post("/embed", json={"sentences": ["A secret sentence here .", ["Two", "words"]]})
        assert answer.status_code == 200, answer.text
    spans = {s.name: s for s in exporter.get_finished_spans()}
    server, endpoint = spans["POST /embed"], spans["fastapi.endpoint"]  # FastAPI's: the route's own span
    assert server.attributes["http.route"] == "/embed" and server.attributes["http.response.status_code"] == 200
    assert endpoint.parent.span_id == server.context.span_id
    for name in STEPS:
        step = spans[name]
        assert step.parent is not None and step.parent.span_id == endpoint.context.span_id, name
        assert step.context.trace_id == server.context.trace_id
        assert server.start_time <= step.start_time <= step.end_time <= server.end_time, name
    assert spans["elmo.queue"].end_time <= spans["elmo.inference"].start_time
    assert spans["elmo.tokenize"].end_time <= spans["elmo.queue"].start_time
    inference = spans["elmo.inference"].attributes
    assert inference["elmo.model"] == settings.models[0][0]
    assert inference["elmo.sentences"] == 2 and inference["elmo.tokens"] == 7  # 5 tokens from Moses, and 2
    assert (
        spans["elmo.tokenize"].attributes["elmo.texts"] == 1 and spans["elmo.tokenize"].attributes["elmo.tokens"] == 7
    )
    assert spans["elmo.encode"].attributes["elmo.encoding"] == "float"
    for span in exporter.get_finished_spans():  # no request text anywhere
        assert "secret" not in str(dict(span.attributes or {})) and "secret" not in span.name
    assert not [s for s in exporter.get_finished_spans() if "health" in s.name]  # the probes make none


def test_the_openai_route_is_traced_the_same_way(settings, provider):
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with TestClient(create_app(settings, tracer_provider=provider)) as client:
        assert client.post("/v1/embeddings", json={"input": ["one text", "and another"]}).status_code == 200
    names = [s.name for s in exporter.get_finished_spans()]
    assert "POST /v1/embeddings" in names and all(step in names for step in STEPS), names


def test_without_a_configured_provider_nothing_is_traced_and_all_is_served(settings, monkeypatch):
    for name in tracing.ENDPOINTS:
        monkeypatch.delenv(name, raising=False)
    assert tracing.telemetry()["auto_configure"] is False
    with TestClient(create_app(settings)) as client:
        assert client.post("/embed", json={"sentences": ["Hello there ."]}).status_code == 200


def test_an_endpoint_without_the_sdk_is_said_once_and_serving_goes_on(monkeypatch, caplog):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    monkeypatch.setattr(tracing, "find_spec", lambda name: None)  # as where the otel extra is not installed
    with caplog.at_level(logging.WARNING, "elmo.service"):
        assert tracing.telemetry()["auto_configure"] is False
    assert "OpenTelemetry SDK is not installed" in caplog.text and "elmo-service[otel]" in caplog.text
    monkeypatch.undo()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:4318/v1/traces")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    assert tracing.telemetry()["auto_configure"] is True  # the SDK is here (the dev install has the otel extra)
    assert os.environ["OTEL_SERVICE_NAME"] == "elmo-service"
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing.telemetry()["auto_configure"] is False
