"""The /explore page's route in the app (no lifespan, so no model is loaded: the page's files never need one):
every file of the package's explore folder served byte for byte from memory, with the Content-Security-Policy and
an ETag, outside the API keys; ELMO_EXPLORE=false turns the route off. The page itself is tested in a real browser
(tests/e2e/test_explore.py)."""

from __future__ import annotations

from importlib import resources

import pytest
from starlette.testclient import TestClient

from service.api.app import create_app
from service.settings import Settings

FILES = {"/explore": "index.html", "/explore/app.js": "app.js", "/explore/vectors.js": "vectors.js",
         "/explore/explore.css": "explore.css"}  # fmt: skip
MEDIA = {"html": "text/html", "js": "text/javascript", "css": "text/css"}


@pytest.fixture(scope="module")
def client():
    return TestClient(create_app(Settings(api_keys=["a-key"])))  # keys on: the page needs none


@pytest.mark.parametrize("path", FILES)
def test_each_file_is_served_as_the_package_holds_it(client, path):
    want = (resources.files("service.api.explore") / FILES[path]).read_bytes()
    answer = client.get(path)
    assert answer.status_code == 200 and answer.content == want
    assert answer.headers["content-type"] == f"{MEDIA[FILES[path].rpartition('.')[2]]}; charset=utf-8"
    assert answer.headers["content-security-policy"].startswith("default-src 'self'")
    assert answer.headers["x-content-type-options"] == "nosniff"
    assert client.get(path, headers={"if-none-match": answer.headers["etag"]}).status_code == 304
    head = client.head(path)
    assert head.status_code == 200 and head.content == b"" and head.headers["content-length"] == str(len(want))


def test_the_page_is_small_and_loads_nothing_from_elsewhere(client):
    total = sum(len(client.get(path).content) for path in FILES)
    assert total <= 100_000, total  # the page weight: HTML + JS + CSS, uncompressed
    for path in FILES:
        text = client.get(path).text
        assert "http://" not in text.replace("http://127.0.0.1", "") and "https://" not in text, path
        assert "<script>" not in text and "style=" not in text, path  # the policy forbids inline script and style


def test_the_api_still_needs_its_key_and_other_paths_pass_on(client):
    assert client.get("/v1/models").status_code == 401
    assert client.get("/explore/no-such-file.js").status_code == 401  # not the page's: the keys' middleware answers
    assert client.post("/explore").status_code == 401


def test_elmo_explore_false_turns_the_route_off():
    off = TestClient(create_app(Settings(explore=False)))
    assert [off.get(path).status_code for path in FILES] == [404] * len(FILES)


def test_the_page_is_served_below_a_root_path():
    behind = TestClient(create_app(Settings()), root_path="/elmo")  # the scope a prefixing proxy or mount gives
    want = (resources.files("service.api.explore") / "index.html").read_bytes()
    answer = behind.get("/explore")  # the client asks for /elmo/explore
    assert answer.status_code == 200 and answer.content == want
