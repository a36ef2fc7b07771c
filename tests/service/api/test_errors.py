"""The one error type, answered once at the edge: each kind's status, its detail naming the field, Retry-After on
503s, and OpenAI's shape under /v1/, from a route and from a middleware alike (tests/service/test_errors.py has the
shapes' own cases)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI

from service import errors
from service.api.errors import install, send_error

KINDS = [
    (errors.InvalidRequest("bad", "weights"), 422),
    (errors.TooLarge("big", "sentences[2]"), 413),
    (errors.UnknownModel("nope", ["default"]), 404),
    (errors.ClientGone(), 499),
    (errors.Overloaded("full"), 503),
    (errors.NotReady("starting"), 503),
    (errors.EngineFailed("out of memory"), 503),
]


@pytest.mark.parametrize(("error", "status"), KINDS, ids=[type(e).__name__ for e, _ in KINDS])
def test_every_kind_has_its_status_and_a_detail_naming_the_field(error, status):
    assert error.status == status
    app = FastAPI()
    install(app, retry_after_s=3)

    @app.get("/fail")
    @app.get("/v1/fail")
    async def fail():
        raise error

    async def get(path):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://app") as client:
            return await client.get(path)

    plain, openai = asyncio.run(get("/fail")), asyncio.run(get("/v1/fail"))
    assert plain.status_code == status
    assert plain.json() == {"detail": error.detail}
    assert (plain.headers.get("retry-after") == "3") == (status == 503)
    assert openai.json()["error"]["message"] == error.detail
    assert openai.status_code == {413: 400, 422: 400}.get(status, status)


def test_a_name_a_client_sent_is_cut_in_the_answer():
    error = errors.UnknownModel("x" * 10_000, ["default", "small"])
    assert len(error.detail) < 200 and error.detail.endswith("this server serves: default, small")
    assert error.field == "model"


def test_a_middleware_answers_in_the_shape_of_its_path():
    refused = errors.Overloaded("overloaded: request bodies in flight hold 1 of 1 bytes; retry later")

    async def middleware(scope, receive, send):
        await send_error(scope, send, refused, retry_after_s=2)

    async def get(path):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(middleware), base_url="http://app") as client:
            return await client.post(path)

    plain, openai = asyncio.run(get("/embed")), asyncio.run(get("/v1/embeddings"))
    assert plain.status_code == openai.status_code == 503
    assert plain.json() == {"detail": refused.detail} and plain.headers["retry-after"] == "2"
    assert openai.json() == {"error": {"message": refused.detail, "type": "server_error", "param": None, "code": None}}
    assert openai.headers["retry-after"] == "2" and int(openai.headers["content-length"]) == len(openai.content)
