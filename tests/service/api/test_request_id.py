"""Request ids at the edge (service/api/request_id.py) and the log lines that carry them (service/logs.py): the
caller's id kept when sane and replaced when not, the id on every answer and in every JSON error body, and the
lines written while a request is handled (and its access line) naming it, in text and in JSON, with no request text."""

from __future__ import annotations

import asyncio
import json
import logging
import sys

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

from service.api.errors import install, send_error
from service.api.request_id import SANE, RequestId, note, request_id
from service.errors import InvalidRequest, Unauthorized
from service.logs import JsonFormatter, RequestFields, RequestLog, TextFormatter

log = logging.getLogger("elmo.service")


def app_with_ids(access_log: bool = True) -> FastAPI:
    app = FastAPI()
    install(app, retry_after_s=1)

    @app.post("/embed")
    async def embed(body: dict):
        note(model="default", sentences=1, tokens=3)
        log.info("embedding a request")
        if body.get("fail"):
            raise InvalidRequest("empty sentence", "sentences[0]")
        return {"ok": True}

    @app.post("/v1/embeddings")
    async def openai(body: dict):
        raise InvalidRequest("empty list", "input")

    @app.get("/health/ready")
    async def draining():
        return JSONResponse({"status": "draining"}, status_code=503)

    @app.get("/text-error")
    async def text_error():
        return PlainTextResponse("nope", status_code=500)

    async def refused(scope, receive, send):  # an error a middleware answers, as ApiKeys does
        if scope["path"] == "/refused":
            return await send_error(scope, send, Unauthorized("an API key is required", "authorization"))
        return await inner(scope, receive, send)

    inner = app.build_middleware_stack()
    app.build_middleware_stack = lambda: RequestId(refused, access_log=access_log)
    return app


def call(app, method: str, path: str, headers=None, json=None) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://app") as client:
            return await client.request(method, path, headers=headers, json=json)

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ([b"demo-123"], True),
        ([b"0af7651916cd43dd8448eb211c80319c"], True),
        ([b"1-67891233-abcdef012345678912345678"], True),  # AWS ALB's
        ([b"a" * 128], True),
        ([b"a" * 129], False),
        ([b""], False),
        ([b"has space"], False),
        ([b"new\nline"], False),
        ([b"<script>"], False),
        ("é".encode(), False),
        ([b"one", b"two"], False),  # which counts would be a guess
        ([], False),
    ],
)
def test_a_sane_caller_id_is_kept_and_anything_else_replaced(given, kept):
    given = [given] if isinstance(given, bytes) else given
    rid = request_id(given)
    assert (rid == given[0].decode("latin-1")) is kept if given else not kept
    assert SANE.fullmatch(rid.encode())


def test_every_answer_carries_its_id_and_every_json_error_names_it(caplog):
    app = app_with_ids()
    ok = call(app, "POST", "/embed", {"x-request-id": "demo-123"}, {"a": 1})
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "demo-123" and ok.json() == {"ok": True}

    for path, body, status in [("/embed", {"fail": True}, 422), ("/v1/embeddings", {}, 400), ("/refused", None, 401),
                               ("/no/such/route", None, 404)]:  # fmt: skip
        answer = call(app, "POST" if body is not None else "GET", path, json=body)
        assert answer.status_code == status
        rid = answer.headers["x-request-id"]
        assert len(rid) == 32 and answer.json()["request_id"] == rid, answer.text
        assert int(answer.headers["content-length"]) == len(answer.content)
    assert call(app, "POST", "/v1/embeddings", json={}).json()["error"]["param"] == "input"  # OpenAI's shape kept

    draining = call(app, "GET", "/health/ready")  # an answer, not an error: its shape kept
    assert draining.json() == {"status": "draining"} and draining.headers["x-request-id"]
    plain = call(app, "GET", "/text-error")  # not JSON: left as it is, the header still says the id
    assert plain.text == "nope" and plain.headers["x-request-id"]


def test_the_lines_of_a_request_name_it_and_its_access_line_says_how_it_went(caplog):
    caplog.set_level(logging.INFO)
    caplog.handler.addFilter(RequestFields())
    call(app_with_ids(), "POST", "/embed", {"x-request-id": "demo-123"}, {"sentences": ["a secret sentence"]})
    inside = next(r for r in caplog.records if r.getMessage() == "embedding a request")
    assert inside.request == {"request_id": "demo-123", "method": "POST", "route": "/embed", "model": "default",
                              "sentences": 1, "tokens": 3}  # fmt: skip
    access = next(r for r in caplog.records if r.name == "elmo.access")
    assert access.getMessage() == "POST /embed" and access.request["request_id"] == "demo-123"
    assert access.fields["status"] == 200 and access.fields["duration_ms"] > 0 and access.fields["tokens"] == 3
    assert "secret" not in caplog.text

    caplog.clear()
    call(app_with_ids(access_log=False), "POST", "/embed", json={})
    assert not [r for r in caplog.records if r.name == "elmo.access"]


def record(message: str, **extra) -> logging.LogRecord:
    rec = logging.LogRecord("elmo.service", logging.WARNING, __file__, 1, message, None, None)
    rec.__dict__.update(extra)
    return rec


def test_json_lines_hold_the_fields_and_text_lines_end_with_the_id():
    request = RequestLog("demo-123", "POST", {"path": "/embed"}, model="default", tokens=6)
    fields = request.fields()
    assert fields == {"request_id": "demo-123", "method": "POST", "route": "other", "model": "default", "tokens": 6}
    line = json.loads(JsonFormatter().format(record("queue full", request=fields, fields={"status": 503})))
    assert line["time"].endswith("Z") and line["level"] == "warning" and line["logger"] == "elmo.service"
    assert line["message"] == "queue full" and line["request_id"] == "demo-123" and line["status"] == 503
    assert line["tokens"] == 6 and line["model"] == "default"
    text = TextFormatter().format(record("queue full", request=fields, fields={"status": 503}))
    assert text.endswith("WARNING elmo.service: queue full status=503 [demo-123]")
    assert TextFormatter().format(record("started", request=None)).endswith("elmo.service: started")

    try:
        raise RuntimeError("boom")
    except RuntimeError:
        failed = json.loads(JsonFormatter().format(record("failed", exc_info=sys.exc_info())))
    assert "RuntimeError: boom" in failed["exception"] and "\n" not in JsonFormatter().format(record("a\nb"))
    long = RequestLog("x", "GET", {"path": "/" + "a" * 1000})
    assert long.fields()["route"] == "other" and "path" not in long.fields()  # no route matched: never the path
    forged = TextFormatter().format(record("GET /x\r\n2026 INFO fake\x1b[2K\u2028", fields={"client": "a\nb"}))
    assert forged.endswith("GET /x\\x0d\\x0a2026 INFO fake\\x1b[2K\\u2028 client=a\\x0ab")
