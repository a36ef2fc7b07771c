"""allennlp 2.10.1's own Elmo tests (elmo_test.py, vendored) against elmo_client.elmo.Elmo and a real elmo-serve of
the fixture model, found through $ELMO_URL as a migrated program finds it. They need allennlp itself (its data
classes, its _ElmoBiLm): collected only where it imports, which is the allennlp environment (`make allennlp`;
tests/client/test_allennlp210_elmo_tests.py runs them there); elsewhere the folder is skipped."""

from __future__ import annotations

import importlib
import importlib.util

import pytest

from tests.conftest import TINY
from tests.live_server import running_server

# What a served biLM cannot do as allennlp's own does, said once (docs/allennlp.md): strict, so that a change that
# makes one of them pass is noticed.
XFAIL = {
    "test_elmo_with_module": "module=: the biLM is the server's model, and a torch module of the user's cannot run "
    "there (refused with a ConfigurationError that says so)",
}

if importlib.util.find_spec("allennlp") is None:
    collect_ignore = ["elmo_test.py"]
else:
    # the fixture model's export (onnx, and protobuf under google.*) first: the stubs of what allennlp imports and
    # ELMo never uses take every module of those names imported after them, google.* among them
    importlib.import_module("model_export.export")
    importlib.import_module("bench.allennlp_baseline")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.fspath.basename == "elmo_test.py" and item.name in XFAIL:
            item.add_marker(pytest.mark.xfail(reason=XFAIL[item.name], strict=True))


@pytest.fixture(scope="session", autouse=True)
def allennlp_fixtures(tmp_path_factory):
    """allennlp's FIXTURES_ROOT (its source tree's test_fixtures/, not in the wheel) as a folder whose elmo/ is
    tests/fixtures/elmo-tiny: allennlp's ELMo test fixture, kept unchanged there."""
    from allennlp.common.testing import AllenNlpTestCase

    root = tmp_path_factory.mktemp("allennlp-fixtures")
    (root / "elmo").symlink_to(TINY, target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AllenNlpTestCase, "FIXTURES_ROOT", root)
        yield root


@pytest.fixture(scope="module", autouse=True)
def elmo_url(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("allennlp210")
    with running_server(tiny_model_dir, folder) as server, pytest.MonkeyPatch.context() as mp:
        mp.setenv("ELMO_URL", server.url)
        yield server.url
