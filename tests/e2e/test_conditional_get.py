"""If-None-Match on a real elmo-serve: the OpenAPI document's ETag, a weak one or '*' (alone or in a list) gets 304
with no body and the same ETag."""

from __future__ import annotations

import pytest

from tests.live_server import running_server


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("conditional-get")) as s:  # the default limits
        yield s


@pytest.mark.parametrize("tag", ['W/"{etag}"', "*", '"other", W/"{etag}"'])
def test_if_none_match_with_a_weak_etag_or_a_star_is_304(client, tag):
    etag = client.get("/openapi.json").headers["etag"]
    given = tag.format(etag=etag.strip('"'))
    response = client.get("/openapi.json", headers={"if-none-match": given})
    assert response.status_code == 304, (given, response.status_code)
    assert response.content == b"" and response.headers["etag"] == etag
