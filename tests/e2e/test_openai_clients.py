"""The clients people already use for OpenAI's embeddings API, unchanged, against a real elmo-serve on 127.0.0.1:
the `openai` package and LangChain's OpenAIEmbeddings (langchain-openai). Their vectors are /embed's (the same
batch, mean-pooled, the default mix: the same bits), and when a request fails their exceptions carry the reason
the service gave, in OpenAI's error shape, with OpenAI's status codes."""

from __future__ import annotations

import base64
import socket

import numpy as np
import openai
import pytest
from langchain_openai import OpenAIEmbeddings

from tests.live_server import running_server

TEXTS = ["The bank of the river.", "She went to the bank to deposit money.", "Hello, world!"]
NAME = "tiny"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("openai"), {"ELMO_MODEL_NAME": NAME}) as s:
        yield s


@pytest.fixture(scope="module")
def openai_client(server):
    # no retries: a test that fails shows its first answer, not the last of several
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def pooled(client, texts: list[str]) -> np.ndarray:
    """/embed's answer for the same texts: the mean over tokens of the default mix, one float32 row per text."""
    response = client.post("/embed", json={"sentences": texts, "pooling": "mean", "model": NAME})
    assert response.status_code == 200, response.text
    return np.asarray([item["embedding"] for item in response.json()["data"]], dtype=np.float32)


def vectors(answer) -> np.ndarray:
    """The answer's vectors; base64 asked for explicitly is left to the caller to decode (little-endian float32)."""
    assert [item.index for item in answer.data] == list(range(len(answer.data)))
    return np.asarray(
        [
            np.frombuffer(base64.b64decode(item.embedding), "<f4")
            if isinstance(item.embedding, str)
            else item.embedding
            for item in answer.data
        ],
        dtype=np.float32,
    )


def test_strings_one_string_float_and_base64_are_embed_s_vectors(openai_client, client):
    want = pooled(client, TEXTS)
    # The package asks for base64 unless told otherwise, and then decodes it itself.
    for encoding in (openai.NOT_GIVEN, "float", "base64"):
        answer = openai_client.embeddings.create(model=NAME, input=TEXTS, encoding_format=encoding)
        assert answer.model == NAME and answer.usage.prompt_tokens == answer.usage.total_tokens == 6 + 9 + 4
        np.testing.assert_array_equal(vectors(answer), want)
    one = openai_client.embeddings.create(model=NAME, input=TEXTS[1])
    np.testing.assert_array_equal(vectors(one), pooled(client, TEXTS[1:2]))


def test_dimensions_the_model_s_is_served_another_is_refused_naming_it(openai_client, client):
    answer = openai_client.embeddings.create(model=NAME, input=TEXTS[:1], dimensions=32)
    np.testing.assert_array_equal(vectors(answer), pooled(client, TEXTS[:1]))
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.embeddings.create(model=NAME, input=TEXTS[:1], dimensions=8)
    error = refused.value
    assert (error.status_code, error.param, error.type, error.code) == (
        400,
        "dimensions",
        "invalid_request_error",
        None,
    )
    assert "dimensions: 8 asked for; this model's vectors have 32" in str(error)


def test_an_unknown_model_is_model_not_found(openai_client):
    with pytest.raises(openai.NotFoundError) as refused:
        openai_client.embeddings.create(model="text-embedding-3-small", input="a")
    error = refused.value
    assert (error.status_code, error.param, error.code) == (404, "model", "model_not_found")
    assert str(error) == ("Error code: 404 - model: unknown model 'text-embedding-3-small'; this server serves: tiny")
    with pytest.raises(openai.NotFoundError) as refused:
        openai_client.models.retrieve("text-embedding-3-small")
    assert refused.value.code == "model_not_found"
    assert [m.id for m in openai_client.models.list()] == [NAME]
    assert openai_client.models.retrieve(NAME).id == NAME


BAD_INPUT = [  # (id, input, param, what the message says)
    ("empty-list", [], "input", "input: empty list"),
    ("empty-text", ["fine", " "], "input[1]", "input[1]: empty sentence"),
    ("token-ids", [464, 4776, 13], "input", "check_embedding_ctx_length=False"),
    ("token-id-lists", [[464, 4776], [13]], "input", "check_embedding_ctx_length=False"),
    ("too-many", ["a"] * 513, "input", "input: 513 sentences; the limit is 512 per request"),
]


@pytest.mark.parametrize(("text", "param", "says"), [b[1:] for b in BAD_INPUT], ids=[b[0] for b in BAD_INPUT])
def test_bad_input_is_a_bad_request_whose_exception_says_why(openai_client, text, param, says):
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.embeddings.create(model=NAME, input=text)
    error = refused.value
    assert (error.status_code, error.param, error.type) == (400, param, "invalid_request_error")
    assert says in str(error) and str(error).startswith(f"Error code: 400 - {param}: ")


@pytest.fixture()
def loopback_only(monkeypatch):
    """Names looked up during the test; any but the loopback's is refused (the test then fails). tiktoken, which
    LangChain's default path runs, would download its encodings here: this shows that the path used does not."""
    looked_up: list[str] = []
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        looked_up.append(host)
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise OSError(f"network access attempted: {host}")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return looked_up


def test_langchain_openai_embeddings_without_its_tokenizer(server, client, loopback_only, tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # empty: no encoding from an earlier download
    embeddings = OpenAIEmbeddings(
        model=NAME, base_url=f"{server.url}/v1", api_key="unused", check_embedding_ctx_length=False, max_retries=0
    )
    documents = np.asarray(embeddings.embed_documents(TEXTS), dtype=np.float32)
    np.testing.assert_array_equal(documents, pooled(client, TEXTS))
    query = np.asarray(embeddings.embed_query(TEXTS[0]), dtype=np.float32)
    np.testing.assert_array_equal(query, pooled(client, TEXTS[:1])[0])
    assert loopback_only and set(loopback_only) == {"127.0.0.1"}  # the server, and nothing else
    assert not list(tmp_path.iterdir())  # tiktoken downloaded nothing
