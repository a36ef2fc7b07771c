"""Canaries: every engine proves its graph at start-up against the reference layers its export stored. A graph
file altered on purpose makes a real elmo-serve refuse to start, naming graph, provider and figures; ELMO_CANARY=warn
serves it and says so in /info and the metrics; an export from before canaries is served, with a clear log line."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import httpx
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from service.engine import canary
from service.engine.canary import FP32_TOLERANCE, CanaryMismatch, allowance, check, cosine_min, prove
from service.engine.providers import choose_graph
from service.engine.session import Engine
from service.manifest import read_manifest, sha256
from tests.live_server import counter, refused_to_start, running_server


def altered(tiny_model_dir: Path, folder: Path, graph: str, initializer: str, change, resum: bool = True) -> Path:
    """A copy of the export whose `graph` file has the first initializer named `initializer`... changed; with
    `resum`, its manifest records the changed file's sha256 (one who changes a graph can change the manifest
    too: the canaries must still catch it), else the sum of the file as exported."""
    shutil.copytree(tiny_model_dir, folder)
    model = onnx.load(str(folder / graph))
    tensor = next(t for t in model.graph.initializer if t.name.startswith(initializer))
    tensor.CopyFrom(numpy_helper.from_array(change(numpy_helper.to_array(tensor)), tensor.name))
    onnx.save(model, str(folder / graph))
    if resum:
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest.setdefault("files", {})[graph] = sha256(folder / graph)
        (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def served_int8(model_dir: Path) -> str:
    """The int8 graph an engine serves from `model_dir` on this CPU (chosen by its flags: engine/providers.py)."""
    return choose_graph(read_manifest(model_dir), "loop", "int8").file.name


def changed_row(table: np.ndarray, row: int) -> np.ndarray:
    table = table.copy()
    table[row] += 0.5
    return table


def test_a_graph_changed_after_export_is_refused_by_its_sum(tiny_model_dir, tmp_path):
    model_dir = altered(tiny_model_dir, tmp_path / "m", "model.onnx", "b_proj", lambda b: b + 1e-3, resum=False)
    text = refused_to_start(model_dir, tmp_path / "server.log", {})
    assert f"{model_dir / 'model.onnx'}: its sha256 is {sha256(model_dir / 'model.onnx')}, and the manifest" in text
    assert "changed or damaged after export; export it again with elmo-export" in text


def test_a_manifest_without_sums_is_refused(tiny_model_dir, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(tiny_model_dir, old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["files"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    text = refused_to_start(old, tmp_path / "server.log", {})
    assert "records no sha256 of its files" in text and "export it again with elmo-export" in text, text


@pytest.mark.parametrize("byte", [ord("Z"), 0x00, 0xF4])
def test_a_changed_row_of_the_char_table_changes_a_canary(tiny_model_dir, tmp_path, byte):
    """Every byte UTF-8 text can hold is in a canary: a copy of model.onnx with one row of the char embedding
    changed (the byte's id is byte + 1), its manifest's sum made to match, is refused by its canaries (before:
    the five sentences held 49 byte values, and 'Z' was not one: error 0, served)."""
    model_dir = altered(tiny_model_dir, tmp_path / "m", "model.onnx", "char_embed", lambda t: changed_row(t, byte + 1))
    text = refused_to_start(model_dir, tmp_path / "server.log", {})
    assert "graph model.onnx (fp32) on CPUExecutionProvider: canaries DISAGREE" in text, text


def test_the_canaries_hold_every_byte_utf8_text_can_hold(tiny_model_dir):
    sentences = json.loads((tiny_model_dir / "manifest.json").read_text())["canaries"]["sentences"]
    seen = {b for sentence in sentences for token in sentence for b in token.encode("utf-8")}
    assert seen == set(range(256)) - {0xC0, 0xC1, *range(0xF5, 0x100)}  # 243: what UTF-8 text can hold
    cut = Engine(tiny_model_dir, provider="cpu", intra_op_threads=1).info.mapping.max_bytes
    assert all(len(token.encode("utf-8")) <= cut for token in sentences[-1])  # each read whole, nothing cut off


def test_an_altered_int8_graph_is_refused_naming_graph_provider_and_figures(tiny_model_dir, tmp_path):
    served = served_int8(tiny_model_dir)  # the token projection's scales, in both int8 graphs
    model_dir = altered(tiny_model_dir, tmp_path / "m", served, "w_proj_scale", lambda s: s * 1.2)
    text = refused_to_start(model_dir, tmp_path / "server.log", {"ELMO_PRECISION": "int8"})
    stated = next(g for g in json.loads((model_dir / "manifest.json").read_text())["graphs"] if g["file"] == served)
    stated_error = stated["accuracy"]["max_abs_error_vs_fp32"]
    assert f"model 'm': graph {served} (int8) on CPUExecutionProvider: canaries DISAGREE" in text, text
    assert f"(allowed <= {stated_error * 1.5 + FP32_TOLERANCE:.3g}, the stated {stated_error:.3g} + 50%)" in text
    assert "max abs error" in text and "min cosine" in text and "ELMO_CANARY=warn" in text


def test_an_altered_fp32_graph_is_refused_at_the_fp32_bar(tiny_model_dir, tmp_path):
    model_dir = altered(tiny_model_dir, tmp_path / "m", "model.onnx", "b_proj", lambda b: b + 1e-3)
    text = refused_to_start(model_dir, tmp_path / "server.log", {})
    assert "graph model.onnx (fp32) on CPUExecutionProvider: canaries DISAGREE" in text, text
    assert "(allowed <= 1e-05, the fp32 bar)" in text


def test_warn_serves_it_and_shows_the_figures(tiny_model_dir, tmp_path):
    served = served_int8(tiny_model_dir)
    model_dir = altered(tiny_model_dir, tmp_path / "m", served, "w_proj_scale", lambda s: s * 1.2)
    settings = {"ELMO_PRECISION": "int8", "ELMO_CANARY": "warn"}
    with running_server(model_dir, tmp_path, settings) as server, httpx.Client(base_url=server.url) as client:
        report = client.get("/info").json()["canary"]
        assert (report["graph"], report["provider"], report["checked"], report["passed"]) == (
            served,
            "CPUExecutionProvider",
            True,
            False,
        )
        assert report["max_abs_error"] > report["allowed_max_abs_error"]
        assert counter(client, "elmo_canary_agree", model="m") == 0
        assert counter(client, "elmo_canary_max_abs_error", model="m") == pytest.approx(report["max_abs_error"])
        assert counter(client, "elmo_canary_min_cosine", model="m") == pytest.approx(report["min_cosine"])
    assert "canaries DISAGREE" in server.log.read_text() and "serving it anyway" in server.log.read_text()


def test_a_sound_server_shows_its_canaries_in_info_and_metrics(tiny_model_dir, tmp_path):
    with running_server(tiny_model_dir, tmp_path) as server, httpx.Client(base_url=server.url) as client:
        report = client.get("/info").json()["canary"]
        assert (report["graph"], report["precision"], report["checked"], report["passed"]) == (
            "model.onnx",
            "fp32",
            True,
            True,
        )
        sentences = json.loads((tiny_model_dir / "manifest.json").read_text())["canaries"]["sentences"]
        tokens = sum(map(len, sentences))
        assert report["max_abs_error"] <= FP32_TOLERANCE and (report["sentences"], report["tokens"]) == (6, tokens)
        assert counter(client, "elmo_canary_agree", model=tiny_model_dir.name) == 1
    assert f"canaries agree with the reference on 6 sentences ({tokens} tokens)" in server.log.read_text()


def test_an_export_without_canaries_is_served_with_a_clear_log_line(tiny_model_dir, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(tiny_model_dir, old)
    (old / canary.CANARIES_FILE).unlink()
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["canaries"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    with running_server(old, tmp_path) as server, httpx.Client(base_url=server.url) as client:
        assert client.get("/info").json()["canary"]["checked"] is False
        assert client.post("/embed", json={"sentences": [["still", "served"]]}).status_code == 200
    assert (
        "model 'old': graph model.onnx (fp32) on CPUExecutionProvider: not checked (this export has no canaries: "
        "export it again with elmo-export)" in server.log.read_text()
    )


@pytest.mark.parametrize(
    ("graph", "precision"),
    [("loop", "fp32"), ("model_int8.onnx", "int8"), ("loop", "int8"), ("window", "fp32"), ("window", "fp16")],
)
def test_every_graph_of_a_fresh_export_passes(tiny_model_dir, graph, precision):
    engine = Engine(tiny_model_dir, provider="cpu", graph=graph, precision=precision, intra_op_threads=1)
    report = check(engine, canary.MARGIN)
    assert report.checked and report.passed, report.describe()
    if precision == "fp32":
        assert report.max_abs_error <= FP32_TOLERANCE and report.allowed_min_cosine is None
    else:  # on the machine that exported it, a reduced precision shows exactly its stated error
        stated = engine.graph.entry["accuracy"]
        assert report.max_abs_error == pytest.approx(stated["max_abs_error_vs_fp32"], rel=1e-6)
        assert report.min_cosine == pytest.approx(stated["min_cosine_vs_fp32"], abs=1e-9)


def test_the_allowance_is_the_fp32_bar_or_the_stated_error_and_margin():
    assert allowance({"precision": "fp32"}, 0.5) == (1e-5, None, "the fp32 bar")
    stated = {"precision": "int8", "accuracy": {"max_abs_error_vs_fp32": 0.1, "min_cosine_vs_fp32": 0.9996}}
    max_abs, min_cosine, bound = allowance(stated, 0.5)
    assert max_abs == pytest.approx(0.15 + 1e-5) and min_cosine == pytest.approx(0.9994) and "+ 50%" in bound
    with pytest.raises(CanaryMismatch, match="states no accuracy"):
        allowance({"precision": "fp16", "file": "model_window_fp16.onnx"}, 0.5)


def test_cosine_of_two_zero_vectors_is_one():
    zero, one = np.zeros((1, 2, 4), np.float32), np.ones((1, 2, 4), np.float32)
    assert cosine_min([zero], [zero]) == 1.0
    assert cosine_min([one], [-one]) == pytest.approx(-1.0)


class FakeCudaSession:
    """ONNX Runtime's CPU session, reporting CUDAExecutionProvider: no GPU on this machine, so the CUDA path's
    canary check is exercised on a stand-in provider (its numbers are the CPU's, optionally spoiled)."""

    def __init__(self, session, spoil: float = 0.0):
        self._session, self._spoil = session, spoil

    def get_providers(self):
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]

    def run(self, names, feeds, options=None):
        out = self._session.run(names, feeds, options)
        return [o + self._spoil if n.startswith("layers_") else o for n, o in zip(names, out, strict=True)]

    def __getattr__(self, name):
        return getattr(self._session, name)


def fake_cuda(monkeypatch, spoil: float = 0.0, placement: str = "") -> None:
    from service.engine import providers

    real_open = providers._open
    monkeypatch.setattr(providers, "choose_providers", lambda _: ["CUDAExecutionProvider", "CPUExecutionProvider"])

    def cuda_open(info, cuda, graph, precision, options, device_id, cuda_graphs):
        chosen, session, _ = real_open(info, False, "loop" if graph == "auto" else graph, precision, options, 0, False)
        return chosen, FakeCudaSession(session, spoil), placement

    monkeypatch.setattr(providers, "_open", cuda_open)


PLACEMENT = "\n".join(
    [
        "[V:onnxruntime:, session_state.cc:1598 VerifyEachNodeIsAssignedToAnEp] Node placements",
        "[V:onnxruntime:, session_state.cc:1601 VerifyEachNodeIsAssignedToAnEp]  Node(s) placed on "
        "[CUDAExecutionProvider]. Number of nodes: 2",
        "[V:onnxruntime:, session_state.cc:1603 VerifyEachNodeIsAssignedToAnEp]   MatMul (lstm0/step/step_matmul_9)",
        "[V:onnxruntime:, session_state.cc:1601 VerifyEachNodeIsAssignedToAnEp]  Node(s) placed on "
        "[CPUExecutionProvider]. Number of nodes: 1",
        "[V:onnxruntime:, session_state.cc:1603 VerifyEachNodeIsAssignedToAnEp]   Squeeze (squeeze_12)",
    ]
)


def test_on_cuda_the_canaries_run_and_wrong_numbers_are_refused(tiny_model_dir, monkeypatch):
    fake_cuda(monkeypatch)  # a stand-in for CUDA (see FakeCudaSession): the check runs whatever the provider
    sound = Engine(tiny_model_dir, provider="cuda", graph="loop")
    assert sound.provider == "CUDAExecutionProvider"
    assert prove(sound, "m").passed
    fake_cuda(monkeypatch, spoil=2e-5)  # a provider 2e-5 off on every number
    spoiled = Engine(tiny_model_dir, provider="cuda", graph="loop")
    with pytest.raises(CanaryMismatch, match=r"graph model.onnx \(fp32\) on CUDAExecutionProvider: canaries DISAGREE"):
        prove(spoiled, "m")


def test_on_cuda_the_loop_graph_warns_of_nodes_off_the_gpu_and_the_window_graph_refuses(
    tiny_model_dir, monkeypatch, caplog
):
    fake_cuda(monkeypatch, placement=PLACEMENT)  # a recorded placement report: no GPU here (see FakeCudaSession)
    with caplog.at_level(logging.WARNING, logger="elmo.engine"):
        Engine(tiny_model_dir, provider="cuda", graph="loop")
    assert "the Loop graph: ONNX Runtime placed 1 node(s) of model.onnx off the GPU" in caplog.text
    assert "Squeeze (squeeze_12) on CPUExecutionProvider" in caplog.text
    with pytest.raises(RuntimeError, match=r"placed 1 node\(s\) of model_window.onnx off the GPU: Squeeze"):
        Engine(tiny_model_dir, provider="cuda", graph="window")
