"""The one error type turned into bytes (service/errors.py): the service's own shape, OpenAI's shape with `param`
taken from the error's field (never from its message), and the whole HTTP answer the protocol writes; the routes'
answers in these shapes, end to end, are tested in tests/e2e/test_api.py, tests/e2e/test_access.py,
tests/e2e/test_several_models.py and, through the `openai` package, tests/e2e/test_openai_clients.py."""

from __future__ import annotations

import orjson
import pytest

from service.api.errors import PARAMS
from service.errors import (
    BadRequest,
    InvalidRequest,
    Overloaded,
    ServiceError,
    TooLarge,
    TooSlow,
    Unauthorized,
    UnknownModel,
    answer_headers,
    http_answer,
    native_body,
    openai_body,
    openai_status,
)

CASES = [  # the error -> (OpenAI's status, type, param, code)
    (InvalidRequest("empty sentence", "input[2]"), 400, "invalid_request_error", "input[2]", None),
    (InvalidRequest("Input should be a valid string", "input.str"), 400, "invalid_request_error", "input", None),
    (InvalidRequest("Input should be a valid string", "input.list[str].1"), 400, "invalid_request_error", "input",
     None),
    (InvalidRequest("Input should be a valid string", "input.3"), 400, "invalid_request_error", "input[3]", None),
    (InvalidRequest("invalid JSON at character 3: expected value", "body"), 400, "invalid_request_error", None, None),
    (TooLarge("600 sentences; the limit is 512 per request", "input"), 400, "invalid_request_error", "input", None),
    (TooLarge("larger than the limit of 8388608 bytes", "body"), 400, "invalid_request_error", None, None),
    (UnknownModel("x", ["default"]), 404, "invalid_request_error", "model", "model_not_found"),
    (ServiceError("Not Found", status=404), 404, "invalid_request_error", None, None),
    (Unauthorized("an API key is required", "authorization"), 401, "invalid_request_error", None, "invalid_api_key"),
    (Overloaded("overloaded: model default's queue holds 65000 tokens"), 503, "server_error", None, None),
    (TooSlow("too slow (10 bytes in 10.0 s)", "body"), 408, "invalid_request_error", None, None),
    (InvalidRequest("a message that says input[2]: is wrong", None), 400, "invalid_request_error", None, None),
]  # fmt: skip


@pytest.mark.parametrize(("error", "status", "kind", "param", "code"), CASES)
def test_openai_shape(error, status, kind, param, code):
    assert openai_status(error) == status
    assert orjson.loads(openai_body(error, PARAMS)) == {
        "error": {"message": error.detail, "type": kind, "param": param, "code": code}
    }


def test_the_native_shape_names_the_field_and_carries_extra_keys():
    error = InvalidRequest("Input should be a valid string", "sentences.0", extra={"errors": [{"loc": ["x"]}]})
    assert orjson.loads(native_body(error)) == {
        "detail": "sentences.0: Input should be a valid string",
        "errors": [{"loc": ["x"]}],
    }


def test_retry_after_on_a_503_its_own_or_the_servers():
    assert (b"retry-after", b"7") in answer_headers(Overloaded("full"), 10, retry_after_s=7)
    assert (b"retry-after", b"1") in answer_headers(Overloaded("full", retry_after=1), 10, retry_after_s=7)
    assert not any(name == b"retry-after" for name, _ in answer_headers(TooLarge("big"), 10, retry_after_s=7))


def test_the_protocols_answer_is_whole_http_and_closes():
    answer = http_answer(BadRequest("not valid HTTP/1.1", "request"), [(b"server", b"uvicorn")])
    head, body = answer.split(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 400 Bad Request" and b"server: uvicorn" in lines and b"connection: close" in lines
    assert b"content-length: %d" % len(body) in lines
    assert orjson.loads(body) == {"detail": "request: not valid HTTP/1.1"}
    assert http_answer(ServiceError("over", "headers", status=431)).startswith(
        b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    )
