"""Access control end to end, on a real elmo-serve with API keys and one CORS origin: every route but the two
health probes needs a key, keys never show, CORS answers only the configured origin, and request text reaches
the log only because ELMO_LOG_REQUEST_TEXT asks for it (tests/e2e/test_api.py checks the default: never)."""

from __future__ import annotations

import pytest
from elmo_client import Client, ElmoError

from tests.live_server import refusal, running_server

KEYS = ["k3y-first-0123456789", "k3y-second-abcdef"]
ORIGIN = "https://app.example"
SETTINGS = {"ELMO_API_KEYS": ",".join(KEYS), "ELMO_CORS_ORIGINS": ORIGIN, "ELMO_LOG_REQUEST_TEXT": "true"}
ONE = {"sentences": [["a"]]}
PROTECTED = [  # (method, path, body): every route of the OpenAPI document but the probes, and the document
    ("POST", "/embed", ONE),
    ("POST", "/v1/embeddings", {"input": "a"}),
    ("POST", "/tokenize", ONE),
    ("GET", "/info", None),
    ("GET", "/v1/models", None),
    ("GET", "/metrics", None),
    ("GET", "/openapi.json", None),
    ("GET", "/docs", None),
    ("GET", "/redoc", None),
    ("GET", "/static-offline-docs/swagger-ui-bundle.js", None),  # what /docs loads
    ("GET", "/v1/models/no-such-model", None),  # with a key: 404
    ("GET", "/no/such/route", None),
]
ANSWERED = PROTECTED[:-2]  # with a key: 200
WRONG = {
    "none": {},
    "empty": {"authorization": ""},
    "bearer-nothing": {"authorization": "Bearer"},
    "wrong-key": {"authorization": "Bearer k3y-first-012345678"},  # one character short
    "key-and-more": {"authorization": f"Bearer {KEYS[0]}x"},
    "basic": {"authorization": f"Basic {KEYS[0]}"},
    "no-scheme": {"authorization": KEYS[0]},
    "other-header": {"x-api-key": KEYS[0]},
}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("access"), SETTINGS) as s:
        yield s


def request(client, method, path, body, headers):
    return client.request(method, path, json=body, headers=headers)


@pytest.mark.parametrize("headers", WRONG.values(), ids=WRONG.keys())
@pytest.mark.parametrize(("method", "path", "body"), PROTECTED, ids=[p for _, p, _ in PROTECTED])
def test_without_a_valid_key_every_route_is_401(client, method, path, body, headers):
    response = request(client, method, path, body, headers)
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert refusal(response).startswith("authorization: ")
    if path.startswith("/v1/"):  # as OpenAI answers a wrong key
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert KEYS[0] not in response.text and KEYS[1] not in response.text


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize(("method", "path", "body"), ANSWERED, ids=[p for _, p, _ in ANSWERED])
def test_with_either_key_every_route_answers(client, method, path, body, key):
    for scheme in ("Bearer", "bearer"):  # the scheme is case-insensitive (RFC 9110)
        response = request(client, method, path, body, {"authorization": f"{scheme} {key}"})
        assert response.status_code == 200, response.text


def test_with_a_key_an_unknown_model_is_404_naming_those_served(client, tiny_model_dir):
    response = client.get("/v1/models/no-such-model", headers={"authorization": f"Bearer {KEYS[0]}"})
    assert response.status_code == 404
    assert refusal(response) == f"model: unknown model 'no-such-model'; this server serves: {tiny_model_dir.name}"


def test_the_python_client_raises_the_reason_of_an_openai_shaped_error(server):
    with Client(server.url, connect_retries=0) as elmo, pytest.raises(ElmoError) as refused:
        elmo.models()  # /v1/models: OpenAI's error shape
    assert refused.value.status == 401
    assert refused.value.detail == "authorization: an API key is required (Authorization: Bearer <key>)"


def test_the_health_probes_need_no_key(client):
    assert client.get("/health/live").status_code == 200
    assert client.get("/health/ready").status_code == 200
    assert client.get("/health/ready", headers={"authorization": "Bearer wrong"}).status_code == 200


def test_an_over_limit_body_without_a_key_is_401_unread(client):
    response = client.post("/embed", content=b"x" * (9 << 20), headers={"content-type": "application/json"})
    assert response.status_code == 401  # not 413: refused on the key, before the body


def test_info_never_shows_the_keys(client):
    response = client.get("/info", headers={"authorization": f"Bearer {KEYS[1]}"})
    assert response.json()["settings"]["api_keys"] == ["**********"] * len(KEYS)
    assert not any(key in response.text for key in KEYS)


def test_cors_answers_the_configured_origin_only(client):
    preflight = {"access-control-request-method": "POST", "access-control-request-headers": "authorization"}
    allowed = client.options("/embed", headers={"origin": ORIGIN, **preflight})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    other = client.options("/embed", headers={"origin": "https://evil.example", **preflight})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    # A real request from the origin gets the header, and so does its 401 (the browser can read why).
    answered = client.post("/embed", json=ONE, headers={"origin": ORIGIN, "authorization": f"Bearer {KEYS[0]}"})
    assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == ORIGIN
    refused = client.post("/embed", json=ONE, headers={"origin": ORIGIN})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN


def test_request_text_is_logged_when_asked_for(client, server):
    secret = "Zyzzyva-logged-4417"
    response = client.post("/embed", json={"sentences": [[secret]]}, headers={"authorization": f"Bearer {KEYS[0]}"})
    assert response.status_code == 200
    assert secret in server.log.read_text()
    assert not any(key in server.log.read_text() for key in KEYS)


def chunked_post(port: int, path: str, body: bytes, headers: bytes = b"", trailer: bytes = b"") -> tuple:
    """A POST whose body is chunked, with `trailer` fields after its last chunk; its answer."""
    from tests.live_server import raw_exchange

    head = f"POST {path} HTTP/1.1\r\nhost: [::1]\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n"
    data = head.encode() + headers + b"\r\n" + b"%x\r\n" % len(body) + body + b"\r\n0\r\n" + trailer + b"\r\n"
    ((status, answer_headers, answer),) = raw_exchange(port, data, answers=1)
    return status, answer_headers, answer


def test_a_key_in_a_chunked_trailer_is_not_a_key(server):
    # uvicorn appended trailer fields to the request's headers: a trailer Authorization passed the key check.
    body = b'{"sentences": [["a"]]}'
    trailer = f"authorization: Bearer {KEYS[0]}\r\n".encode()
    status, headers, answer = chunked_post(server.port, "/embed", body, trailer=trailer)
    assert status == 401 and headers["www-authenticate"] == "Bearer", answer
    key = f"authorization: Bearer {KEYS[0]}\r\n".encode()
    status, _, answer = chunked_post(server.port, "/embed", body, headers=key)  # the same, as a header
    assert status == 200, answer


def test_two_authorization_headers_are_refused(client):
    both = [("authorization", f"Bearer {KEYS[0]}"), ("authorization", "Bearer wrong")]
    for headers in (both, both[::-1], [both[0], both[0]]):
        response = client.post("/embed", json=ONE, headers=headers)
        assert response.status_code == 400, response.text
        assert response.json()["detail"] == "authorization: 2 Authorization headers; send one"
