"""Complete requests (right Content-Length) whose JSON body is cut or broken, against a real elmo-serve on
127.0.0.1: each is refused 422 (400 under /v1/) naming the place, whatever its size, the same as a small one
that FastAPI parses on the loop. A body past the off-loop parser's threshold ending right after a comma was a
500 and a 7 KB traceback per request (service/api/bodies.py read past the end of the text)."""

from __future__ import annotations

import json

import httpx
import pytest

from service.api.bodies import INLINE_BYTES
from tests.live_server import refusal, running_server, status_on

JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("cut-bodies")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _whole(route: str, words: int) -> str:
    if route == "/v1/embeddings":
        return json.dumps({"input": ["a b c d e f g h i j k l m n o p q r s t u v w x y z"] * (words // 20)})
    return json.dumps({"sentences": [["a"] * words]})


# each route's body cut after a comma, after a comma and a space, inside a string, after a colon
CUTS = {
    "after-comma": lambda text: text[: text.rindex(",", 0, len(text) - 10) + 1],
    "after-comma-space": lambda text: text[: text.rindex(",", 0, len(text) - 10) + 2],
    "inside-a-string": lambda text: text[: text.rindex('"', 0, len(text) - 10)] + '"a',
    "after-a-colon": lambda text: text[: text.index(":") + 1],
    "two-commas": lambda text: text[: text.rindex(",", 0, len(text) - 10)] + ",," + text[text.rindex(",") + 1 :],
}


@pytest.mark.parametrize("cut", list(CUTS))
@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("route", ["/embed", "/tokenize", "/v1/embeddings"])
def test_a_cut_body_is_refused_naming_the_place(server, client, route, size, cut):
    whole = _whole(route, 40 if size == "small" else 8000)
    body = CUTS[cut](whole).encode()
    assert (len(body) > INLINE_BYTES) == (size == "large") or cut == "after-a-colon"
    before = server.log.read_text()
    response = client.post(route, content=body, headers=JSON)
    assert response.status_code == status_on(route, 422), response.text
    assert "invalid JSON at character" in refusal(response), response.text
    assert "Traceback" not in server.log.read_text()[len(before) :]


def test_the_server_still_serves_after_the_cut_bodies(client):
    response = client.post("/embed", json={"sentences": [["a", "b"]]})
    assert response.status_code == 200
    assert client.get("/health/ready").status_code == 200
