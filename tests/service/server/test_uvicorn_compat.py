"""The server refuses a uvicorn whose internals its protocol was not tested with, by version and by the internals
themselves, and the version range it checks is the one pyproject.toml declares."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.server import serve as server
from service.server.serve import UVICORN_TESTED, uvicorn_problem

ROOT = Path(__file__).resolve().parents[3]


def test_the_installed_uvicorn_is_the_tested_one():
    assert uvicorn_problem() is None, uvicorn_problem()


def test_another_release_is_refused_with_what_to_install():
    for version in ("0.53.9", "0.55.0", "1.0.0", "dev"):
        problem = uvicorn_problem(version)
        assert problem is not None and f"uvicorn {version} is installed" in problem
        assert "install 'uvicorn>=0.54,<0.55'" in problem


def test_a_missing_internal_is_refused_by_name(monkeypatch):
    monkeypatch.delattr(HttpToolsProtocol, "_should_upgrade")
    problem = uvicorn_problem(uvicorn.__version__)
    assert problem is not None and "lacks HttpToolsProtocol._should_upgrade" in problem


def test_pyproject_declares_the_range_the_server_checks():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (declared,) = [d for d in dependencies if re.match(r"uvicorn\b", d)]
    (low, high) = UVICORN_TESTED
    assert declared.replace(" ", "") == f"uvicorn>={low[0]}.{low[1]},<{high[0]}.{high[1]}"


def test_every_internal_the_server_checks_exists_in_the_installed_uvicorn():
    for cls, names in server.INTERNALS.items():
        assert all(hasattr(cls, name) for name in names), cls
