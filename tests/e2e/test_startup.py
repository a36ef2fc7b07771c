"""A real elmo-serve on a model folder that is missing or broken: it exits non-zero with a message that says
what is wrong, and never listens, so no probe can find it half-ready."""

from __future__ import annotations

import shutil

import pytest

from tests.live_server import free_port, launch, refused_to_start, stop, wait_ready

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
    text = refused_to_start(model_dir, log, {})
    assert message.format(dir=model_dir) in text, text


SETTING_MISTAKES = {  # (id): the settings, the lines elmo-serve prints (after its "elmo-serve: ")
    "bad-values": (
        {"ELMO_MAX_SENTENCES": "many", "ELMO_PROVIDER": "gpu", "ELMO_CUDA_GRAPHS": "maybe", "ELMO_BATCH_TOKENS": "0"},
        ["ELMO_BATCH_TOKENS='0' is not valid: it takes an integer of at least 1, or unset",
         "ELMO_MAX_SENTENCES='many' is not valid: it takes an integer of at least 1",
         "ELMO_PROVIDER='gpu' is not valid: it takes one of auto, cpu, cuda",
         "ELMO_CUDA_GRAPHS='maybe' is not valid: it takes true or false"],
    ),
    "conflicting": (
        {"ELMO_MAX_BODY_BYTES": "1000", "ELMO_MAX_INFLIGHT_BYTES": "10"},
        ["ELMO_MAX_INFLIGHT_BYTES (10) is below ELMO_MAX_BODY_BYTES (1000): a body at the limit could never be "
         "taken; raise one or lower the other"],
    ),
    "misspelled-and-bad": (
        {"ELMO_BATCH_TOKEN": "5", "ELMO_LOG_LEVEL": "loud"},
        ["warning: ELMO_BATCH_TOKEN is not a setting and is ignored: did you mean ELMO_BATCH_TOKENS?",
         "ELMO_LOG_LEVEL='loud' is not valid: it takes one of critical, error, warning, info, debug"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", SETTING_MISTAKES, ids=list(SETTING_MISTAKES))
def test_a_bad_setting_stops_startup_with_a_line_naming_it(tiny_model_dir, tmp_path, case):
    settings, lines = SETTING_MISTAKES[case]
    log = tmp_path / "server.log"
    proc = launch(tiny_model_dir, log, settings, free_port())
    assert proc.wait(timeout=60) == 1
    assert log.read_text().splitlines() == [f"elmo-serve: {line}" for line in lines]  # no pydantic report, no URL


def test_a_misspelled_setting_is_warned_about_and_the_server_starts(tiny_model_dir, tmp_path):
    log = tmp_path / "server.log"
    port = free_port()
    proc = launch(tiny_model_dir, log, {"ELMO_MAXWAIT_MS": "5", "ELMO_URL": "http://127.0.0.1:1"}, port)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}", log)
    finally:
        assert stop(proc) == 0
    warnings = [line for line in log.read_text().splitlines() if "warning" in line]
    # ELMO_URL is elmo_client's: not the server's, and not a mistake
    assert warnings == ["elmo-serve: warning: ELMO_MAXWAIT_MS is not a setting and is ignored: did you mean "
                        "ELMO_MAX_WAIT_MS?"]  # fmt: skip


def _graph_changed(folder, change) -> None:
    """model.onnx with one initializer changed by `change(array) -> array`, its sha256 in the manifest updated
    (so that what fails is the graph, not the sums' check)."""
    import json

    import onnx
    from onnx import numpy_helper

    from service.manifest import sha256

    graph = onnx.load(folder / "model.onnx")
    for k, tensor in enumerate(graph.graph.initializer):
        if tensor.name.startswith(change[0]):
            graph.graph.initializer[k].CopyFrom(numpy_helper.from_array(change[1](numpy_helper.to_array(tensor)),
                                                                        tensor.name))  # fmt: skip
            break
    onnx.save(graph, folder / "model.onnx")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["model.onnx"] = sha256(folder / "model.onnx")
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _flipped_byte(folder) -> None:
    raw = bytearray((folder / "model.onnx").read_bytes())
    raw[-100] ^= 0x01
    (folder / "model.onnx").write_bytes(bytes(raw))


BROKEN_AMONG_MODELS = {  # (id): how to break the second model's copy, what its one line says
    "truncated-graph": (lambda d: (d / "model.onnx").write_bytes((d / "model.onnx").read_bytes()[:100_000]),
                        "cannot load the model 'second' from {dir}: InvalidProtobuf"),
    "changed-byte": (_flipped_byte,
                     "cannot load the model 'second' from {dir}: ValueError: {dir}/model.onnx: its sha256"),
    "graph-that-cannot-run": (lambda d: _graph_changed(d, ("w_tr_", lambda w: w[:, :-1])),
                              "the model 'second' from {dir}"),
    "canaries-disagree": (lambda d: _graph_changed(d, ("b_proj_", lambda b: b + 0.1)),
                          "model 'second': graph model.onnx (fp32) on CPUExecutionProvider: canaries DISAGREE"),
}  # fmt: skip


@pytest.mark.parametrize("case", BROKEN_AMONG_MODELS, ids=list(BROKEN_AMONG_MODELS))
def test_a_broken_graph_among_the_models_stops_startup_with_one_line(tiny_model_dir, tmp_path, case):
    model_dir = tmp_path / "second"
    shutil.copytree(tiny_model_dir, model_dir)
    breaking, message = BROKEN_AMONG_MODELS[case]
    breaking(model_dir)
    text = refused_to_start(
        None, tmp_path / "server.log", {"ELMO_MODELS": f"first={tiny_model_dir},second={model_dir}"}
    )
    assert "Traceback" not in text and 'File "' not in text, text  # was 30 lines of it, rc 3 after 2.4 s
    errors = [line for line in text.splitlines() if "ERROR" in line and "Application startup failed" not in line]
    assert len(errors) == 1, text
    assert message.format(dir=model_dir) in errors[0], text
