"""HEAD wherever GET is, and bodies in a content coding refused 415, against a real elmo-serve on 127.0.0.1:
`HEAD /health/ready`, `/info` and `/metrics` answered 405 (load balancers check health with HEAD); gzip was a 422
"UnicodeDecodeError" and `br` on a plain body was served 200 as if no coding were named."""

from __future__ import annotations

import gzip
import json

import httpx
import pytest

from tests.live_server import refusal, running_server

GETS = ["/health/live", "/health/ready", "/info", "/metrics", "/v1/models", "/openapi.json", "/docs", "/explore"]
EMBED = json.dumps({"sentences": [["a", "b"]]}).encode()
BODIES = {"/embed": EMBED, "/tokenize": EMBED, "/v1/embeddings": json.dumps({"input": ["a b"]}).encode()}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("head")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.mark.parametrize("path", GETS)
def test_head_is_answered_wherever_get_is(client, path):
    got = client.get(path)
    assert got.status_code == 200, got.text
    head = client.head(path)
    assert head.status_code == 200, head.text  # was 405 on all but /health/live
    assert head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]
    if "content-length" in got.headers and path not in ("/metrics", "/info"):  # those two change between calls
        assert head.headers["content-length"] == got.headers["content-length"]


def test_head_on_a_post_route_is_405_with_its_allow(client):
    head = client.head("/embed")
    assert head.status_code == 405 and head.headers["allow"] == "POST"


def test_head_needs_the_key_as_get_does(tiny_model_dir, tmp_path):
    with running_server(tiny_model_dir, tmp_path, {"ELMO_API_KEYS": "k1"}) as s:
        assert httpx.head(f"{s.url}/info").status_code == 401
        assert httpx.head(f"{s.url}/info", headers={"authorization": "Bearer k1"}).status_code == 200
        assert httpx.head(f"{s.url}/health/ready").status_code == 200  # open, as its GET


CODED = {
    "gzip": lambda body: gzip.compress(body),
    "br-on-a-plain-body": lambda body: body,
    "identity": lambda body: body,
}


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("coding", list(CODED))
def test_a_body_in_a_content_coding_is_refused_415(client, path, coding):
    name = coding.split("-")[0]
    response = client.post(
        path,
        content=CODED[coding](BODIES[path]),
        headers={"content-type": "application/json", "content-encoding": name},
    )
    assert response.status_code == 415, response.text  # gzip: 422; br, identity: 200
    assert response.headers["accept-encoding"] == "identity"
    assert f"content-encoding: '{name}': bodies are read as sent" in refusal(response)


def test_a_plain_body_is_still_served(client):
    assert client.post("/embed", content=EMBED, headers={"content-type": "application/json"}).status_code == 200
