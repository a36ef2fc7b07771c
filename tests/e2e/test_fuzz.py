"""Property-based fuzzing of the API from its own OpenAPI document, with schemathesis, against a real elmo-serve
on 127.0.0.1: schema-valid and schema-invalid requests to every operation, and each answer checked: no server
error, a documented status, content type and headers, a body that matches the documented schema, and every
schema-invalid request refused with a 4xx (413 among them: a body over a count limit is refused before its items
are validated).

Left out: schemathesis' "schema-valid request accepted" check (ST202). The API validates what JSON Schema
cannot say (a text that tokenizes to nothing, `layers` only with output "layers", as many weights as the
model has layers, layer numbers within the model), so some schema-valid bodies rightly get 422.

The document is taken from the app in this process (schemathesis' lazy fixture loader does not work with this
pytest) and checked to be the one the server serves. Bounded: FUZZ_EXAMPLES per operation, well under a
minute in all on 2 cores."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import positive_data_acceptance

from service.api.app import create_app
from service.settings import Settings
from tests.live_server import running_server

FUZZ_EXAMPLES = 2500
DOCUMENT = create_app(Settings()).openapi()
SCHEMA = schemathesis.openapi.from_dict(DOCUMENT)
# A refusal is a refusal: besides schemathesis' list (400, 422, ...), 413 is how the API refuses a body whose
# counts (sentences, tokens, values) are over its limits, which it checks before the items are built, and so before
# it could say which item breaks the schema (docs/limits.md); 5xx stays a failure (the not-a-server-error check).
SCHEMA.config.checks.negative_data_rejection.expected_statuses.append("413")
SEEN: dict[str, int] = {}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("fuzz")) as s:
        yield s


def test_the_fuzzed_document_is_the_served_one(server):
    assert httpx.get(f"{server.url}/openapi.json").json() == DOCUMENT


@SCHEMA.parametrize()
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_api(case, server):
    SEEN[case.operation.label] = SEEN.get(case.operation.label, 0) + 1
    case.call_and_validate(base_url=server.url, excluded_checks=[positive_data_acceptance])


def test_every_operation_was_fuzzed_and_the_server_never_failed(server):
    print(f"requests per operation: {SEEN}")
    assert set(SEEN) == {f"{m.upper()} {p}" for p, ops in DOCUMENT["paths"].items() for m in ops}
    assert SEEN["POST /embed"] >= FUZZ_EXAMPLES and SEEN["POST /v1/embeddings"] >= FUZZ_EXAMPLES // 2
    assert "Traceback" not in server.log.read_text()
    with httpx.Client(base_url=server.url) as client:
        assert client.get("/health/ready").status_code == 200
        metrics = client.get("/metrics").text
    assert 'status="5' not in metrics
