"""The server refuses a uvicorn the protocol cannot run on: by version, by the methods it overrides, and by a live
self-check of the protocol over a real socket that sees an instance attribute renamed (a class-level `hasattr`
cannot); the version range it checks is the one pyproject.toml declares."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import tomllib
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from service.server import uvicorn_compat
from service.server.protocol import BoundedHttpProtocol
from service.server.serve import check_uvicorn
from service.server.uvicorn_compat import TESTED, UvicornMismatch, version_problem

ROOT = Path(__file__).resolve().parents[3]


def test_the_installed_uvicorn_is_the_tested_one():
    assert version_problem() is None, version_problem()


def test_another_release_is_refused_with_what_to_install():
    for version in ("0.53.9", "0.55.0", "1.0.0", "dev"):
        problem = version_problem(version)
        assert problem is not None and f"uvicorn {version} is installed" in problem
        assert "install 'uvicorn>=0.54,<0.55'" in problem


def test_a_missing_method_is_refused_by_name(monkeypatch):
    monkeypatch.delattr(HttpToolsProtocol, "_should_upgrade")
    problem = version_problem(uvicorn.__version__)
    assert problem is not None and "lacks HttpToolsProtocol._should_upgrade" in problem


def test_pyproject_declares_the_range_the_server_checks():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (declared,) = [d for d in dependencies if re.match(r"uvicorn\b", d)]
    (low, high) = TESTED
    assert declared.replace(" ", "") == f"uvicorn>={low[0]}.{low[1]},<{high[0]}.{high[1]}"


def test_every_method_the_server_checks_exists_in_the_installed_uvicorn():
    for cls, names in uvicorn_compat.METHODS.items():
        assert all(hasattr(cls, name) for name in names), cls


def test_the_live_self_check_passes_on_the_installed_uvicorn_quickly():
    start = time.perf_counter()
    assert check_uvicorn() is None
    assert time.perf_counter() - start < 2.0  # at start-up, before the model loads (about 30 ms on an idle host)


def renamed(monkeypatch, cls, name: str) -> None:
    """Make `cls`'s instances keep the attribute `name` under another name, as a uvicorn release might."""
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.__dict__[name + "_renamed"] = self.__dict__.pop(name)

    monkeypatch.setattr(cls, "__init__", __init__)


@pytest.mark.parametrize(
    ("cls", "name"),
    [
        (RequestResponseCycle, "response_started"),
        (RequestResponseCycle, "disconnected"),
        (RequestResponseCycle, "body"),
        (HttpToolsProtocol, "pipeline"),
        (HttpToolsProtocol, "root_path"),
    ],
)
def test_a_renamed_instance_attribute_fails_the_self_check_with_the_version_and_its_name(monkeypatch, cls, name):
    renamed(monkeypatch, cls, name)
    assert all(hasattr(c, m) for c, methods in uvicorn_compat.METHODS.items() for m in methods)  # blind to it
    with pytest.raises(UvicornMismatch) as failed:
        uvicorn_compat.check(BoundedHttpProtocol)
    message = str(failed.value)
    assert f"uvicorn {uvicorn.__version__}" in message and f"'{name}'" in message, message
    assert "install 'uvicorn>=0.54,<0.55'" in message


def test_a_hook_uvicorn_no_longer_calls_fails_the_self_check(monkeypatch):
    # A release that starts requests by another name than _start_asgi_task would bypass the turns and the
    # liveness answer without an error anywhere: the self-check counts the requests started through the hook.
    monkeypatch.setattr(uvicorn_compat.HttpBase, "_start_asgi_task", uvicorn_compat.HttpBase.run_request)
    with pytest.raises(UvicornMismatch, match=r"requests started through the protocol's hook: \[\]"):
        uvicorn_compat.check(BoundedHttpProtocol)
