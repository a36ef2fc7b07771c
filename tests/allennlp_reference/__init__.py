"""allennlp itself, in an environment of its own (allennlp 2.10.1 beside the project's torch: `make allennlp`), for
the tests that compare with it. Found at $ALLENNLP_PYTHON, else build/allennlp/python; a test that needs it skips
when it is absent, except under CI (CI set), where it fails: CI builds it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def allennlp_python() -> str:
    """The allennlp environment's interpreter, or the test skips (fails under CI) saying how to make one."""
    python = os.environ.get("ALLENNLP_PYTHON") or str(REPO / "build" / "allennlp" / "python")
    if Path(python).is_file():
        return python
    message = f"no allennlp environment at {python}: `make allennlp` builds one (or set ALLENNLP_PYTHON)"
    if os.environ.get("CI"):
        pytest.fail(f"{message}; CI runs every allennlp comparison")
    pytest.skip(message)


def run_allennlp(script: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """tests/allennlp_reference/<script> in the allennlp environment, one thread (the machine is shared)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'client'}"}
    return subprocess.run(
        [allennlp_python(), str(HERE / script), *args], env=env, capture_output=True, text=True, timeout=timeout
    )
