"""A real elmo-serve on a model folder that is missing or broken: it exits non-zero with a message that says
what is wrong, and never listens, so no probe can find it half-ready."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.server import free_port, launch

BROKEN = {  # (id): how to break a copy of the exported tiny model, what the message says
    "truncated-model": (lambda d: (d / "model.onnx").write_bytes((d / "model.onnx").read_bytes()[:100_000]),
                        "cannot load the model 'model' from {dir}: InvalidProtobuf"),
    "no-manifest": (lambda d: (d / "manifest.json").unlink(), "manifest.json not found: is {dir} a folder written by"),
    "no-model-file": (lambda d: (d / "model.onnx").unlink(), "model.onnx not found: the manifest in {dir} names it"),
    "no-folder": (shutil.rmtree, "manifest.json not found: is {dir} a folder written by"),
}  # fmt: skip


@pytest.mark.parametrize("case", BROKEN, ids=list(BROKEN))
def test_a_broken_model_folder_fails_startup_with_a_clear_message(tiny_model_dir, tmp_path, case):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    breaking, message = BROKEN[case]
    breaking(model_dir)
    log = tmp_path / "server.log"
    proc = launch(model_dir, log, {}, free_port())
    try:
        returncode = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"still running 60 s after start:\n{log.read_text()}")
    text = log.read_text()
    assert returncode != 0, text
    assert message.format(dir=model_dir) in text, text
    assert "Uvicorn running" not in text and "Application startup complete" not in text
