"""OpenAI's error shape from the service's own answers (service/api/errors.py); the routes' answers in that
shape, end to end, are tested in tests/e2e/test_api.py, tests/e2e/test_access.py, tests/e2e/test_several_models.py
and, through the `openai` package, tests/e2e/test_openai_clients.py."""

from __future__ import annotations

import pytest

from service.api.errors import openai_error

CASES = [  # (the service's status, its detail) -> (OpenAI's status, type, param, code)
    (422, "input[2]: empty sentence", 400, "invalid_request_error", "input[2]", None),
    (422, "input.str: Input should be a valid string", 400, "invalid_request_error", "input", None),
    (422, "input.list[str].1: Input should be a valid string", 400, "invalid_request_error", "input", None),
    (422, "body: invalid JSON at character 3: expected value", 400, "invalid_request_error", None, None),
    (413, "input: 600 sentences; the limit is 512 per request", 400, "invalid_request_error", "input", None),
    (413, "body: larger than the limit of 8388608 bytes", 400, "invalid_request_error", None, None),
    (404, "model: unknown model 'x'; this server serves: default", 404, "invalid_request_error", "model",
     "model_not_found"),
    (404, "Not Found", 404, "invalid_request_error", None, None),
    (401, "authorization: an API key is required", 401, "invalid_request_error", None, "invalid_api_key"),
    (503, "overloaded: model default's queue holds 65000 tokens", 503, "server_error", None, None),
    (408, "body: too slow (10 bytes in 10.0 s)", 408, "invalid_request_error", None, None),
]  # fmt: skip


@pytest.mark.parametrize(("status", "detail", "openai_status", "kind", "param", "code"), CASES)
def test_openai_error(status, detail, openai_status, kind, param, code):
    assert openai_error(status, detail) == (
        openai_status,
        {"error": {"message": detail, "type": kind, "param": param, "code": code}},
    )
