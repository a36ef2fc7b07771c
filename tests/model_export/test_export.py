"""elmo-export: ONNX Runtime equals the reference on the fixtures, any length, any batch, any architecture."""

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest

from model_export import export as export_module
from model_export.export import ExportError, export_model, torch_layers
from model_export.options import load_options
from model_export.weights import random_bilm
from service.engine.session import Engine
from tests.conftest import max_error


def test_onnx_matches_allennlp_on_every_layer(engine, sentences, expected):
    assert max_error(engine.run(sentences), expected) <= 1e-5


def test_onnx_matches_allennlp_one_sentence_at_a_time(engine, sentences, expected):
    assert max_error([engine.run([s])[0] for s in sentences], expected) <= 1e-5


def test_manifest(tiny_model_dir, tiny_dir):
    manifest = json.loads((tiny_model_dir / "manifest.json").read_text())
    assert manifest["num_layers"] == 3 and manifest["output_dim"] == 32
    assert manifest["architecture"] == load_options(tiny_dir / "options.json").to_dict()
    assert manifest["parity"]["max_abs_error"] <= 1e-5
    assert len(manifest["sources"]["weights"]["sha256"]) == 64
    assert {"opset", "onnxruntime_version", "onnx_version"} <= manifest.keys()


def test_graph_has_dynamic_batch_and_length_and_a_real_loop(tiny_model_dir):
    model = onnx.load(str(tiny_model_dir / "model.onnx"))
    assert sum(node.op_type == "Loop" for node in model.graph.node) == 2  # one per layer, not unrolled
    for name in ("index_fwd", "index_bwd"):
        index = next(i for i in model.graph.input if i.name == name)
        assert [d.dim_param for d in index.type.tensor_type.shape.dim] == ["batch", "time"]


@pytest.mark.parametrize("length", [1, 2, 299, 1000])
def test_any_length(engine, tiny_bilm, length):
    sentence = [f"tok{i % 37}" for i in range(length)]
    (got,) = engine.run([sentence])
    assert got.shape == (3, length, 32)
    assert max_error([got], torch_layers(tiny_bilm, [sentence])) <= 1e-5


@pytest.mark.parametrize("chars", [0, 48, 49, 50, 51, 10_000])
def test_token_lengths(engine, tiny_bilm, chars):
    sentence = ["a", "é" * (chars // 2) + "x" * (chars % 2), "z"]
    assert max_error(engine.run([sentence]), torch_layers(tiny_bilm, [sentence])) <= 1e-5


def test_non_ascii_emoji_control_characters(engine, tiny_bilm):
    batch = [["naïve", "日本語", "🙂👍🏽"], ["\x00", "\t\x1b[31m", "\u200b", "a\ud800b"], ["<S>", "</S>", "<unk>"]]
    assert max_error(engine.run(batch), torch_layers(tiny_bilm, batch)) <= 1e-5


def test_batch_invariance_next_to_a_300_token_sentence(engine, sentences):
    alone = engine.run([sentences[4]])[0]
    long = [f"word{i}" for i in range(300)]
    for batch in ([long, sentences[4]], [sentences[4], long, sentences[0]]):
        batched = engine.run(batch)[batch.index(sentences[4])]
        assert np.abs(batched - alone).max() <= 1e-6


def test_duplicate_tokens_across_sentences_get_their_own_context(engine):
    a, b = engine.run([["bank", "of", "the", "river"], ["the", "bank", "loan"]])
    np.testing.assert_allclose(a[0, 0], b[0, 1], atol=1e-6)  # same token vector
    assert np.abs(a[2, 0] - b[2, 1]).max() > 1e-3  # different contexts


ARCHITECTURES = {
    "tanh, 1 layer, no highway": {"activation": "tanh", "n_layers": 1, "n_highway": 0},
    "3 layers, no skip, no clip": {"n_layers": 3, "skip_connections": False, "cell_clip": None, "proj_clip": None},
    "3 layers with skip, 1 highway": {"n_layers": 3, "n_highway": 1, "cell_dim": 24, "proj_dim": 8},
    "wide filters, small clip": {"filters": ((1, 3), (3, 5), (7, 6)), "cell_clip": 0.5, "proj_clip": 0.2},
}


@pytest.mark.parametrize("change", ARCHITECTURES.values(), ids=ARCHITECTURES.keys())
def test_other_architectures_export_exactly(tiny_dir, tmp_path, change):
    opt = load_options(tiny_dir / "options.json")
    model = random_bilm(type(opt)(**{**opt.__dict__, **change}), seed=7)
    manifest = export_model(model, tmp_path)
    assert manifest["parity"]["max_abs_error"] <= 1e-5
    batch = [["Some", "words", "here", "."], ["x"] * 40, ["ünï"]]
    got = Engine(tmp_path, provider="cpu").run(batch)
    assert max_error(got, torch_layers(model, batch)) <= 1e-5
    assert got[0].shape == (model.options.n_layers + 1, 4, model.options.output_dim)


def test_large_models_use_external_data(tiny_bilm, tmp_path, monkeypatch):
    monkeypatch.setattr(export_module, "EXTERNAL_DATA_BYTES", 1000)
    export_model(tiny_bilm, tmp_path)
    assert (tmp_path / "model.onnx.data").stat().st_size > (tmp_path / "model.onnx").stat().st_size
    assert Engine(tmp_path, provider="cpu").run([["ok"]])[0].shape == (3, 1, 32)


def test_export_fails_loudly_when_onnx_disagrees(tiny_bilm, tmp_path, monkeypatch):
    real = export_module.torch_layers
    monkeypatch.setattr(export_module, "torch_layers", lambda m, s, k: [x + 1e-4 for x in real(m, s, k)])
    with pytest.raises(ExportError, match="differs"):
        export_model(tiny_bilm, tmp_path / "out")
    assert not (tmp_path / "out" / "model.onnx").exists()


def test_cli(tiny_dir, tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "model_export.cli", "--options", str(tiny_dir / "options.json"),
         "--weights", str(tiny_dir / "lm_weights.hdf5"), "--out", str(tmp_path)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "max abs error" in run.stdout and (tmp_path / "model.onnx").exists()
    bad = subprocess.run(
        [sys.executable, "-m", "model_export.cli", "--options", str(tiny_dir / "options.json"),
         "--weights", str(tiny_dir / "options.json"), "--out", str(tmp_path / "bad")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert bad.returncode == 1 and "elmo-export:" in bad.stderr and "Traceback" not in bad.stderr


def test_every_node_is_named_for_where_it_is(tiny_model_dir):
    """ONNX Runtime names a node by its name in logs and placement refusals (unnamed, they read `Squeeze ()`)."""
    for file, scopes in [
        ("model.onnx", {"char_cnn", "highway0", "highway1", "projection", "lstm0", "lstm1", "lstm0/step"}),
        ("model_int8.onnx", {"char_cnn", "highway1", "projection", "lstm1", "lstm1/step"}),
        ("model_window.onnx", {"char_cnn", "highway0", "projection", "lstm0", "lstm1"}),  # both directions at once
        ("model_window_fp16.onnx", {"highway0", "lstm1"}),
    ]:
        model = onnx.load(str(tiny_model_dir / file))
        graphs = [model.graph, *(a.g for n in model.graph.node for a in n.attribute if a.name == "body")]
        for graph in graphs:
            names = [node.name for node in graph.node]
            assert all(names) and len(set(names)) == len(names), file  # named, each once in its graph
        seen = {node.name.rpartition("/")[0] for graph in graphs for node in graph.node}
        assert scopes <= seen, (file, seen)


def test_the_loop_graphs_convolve_chars_as_one_product_per_width(tiny_model_dir, tiny_bilm):
    """The CPU's Loop graphs multiply each token's char windows by each width's filters in one MatMul (ONNX
    Runtime's Conv ran them at half the rate of the products around them); the window graph keeps Conv (cuDNN's).
    Their numbers agree: test_window_graph.py compares the two graphs, and the tests above compare with allennlp."""
    widths = len(tiny_bilm.options.filters)
    for file in ("model.onnx", "model_int8.onnx", "model_window.onnx"):
        nodes = onnx.load(str(tiny_model_dir / file)).graph.node
        convs = sum(node.op_type == "Conv" for node in nodes)
        products = sum(node.op_type == "MatMul" and node.name.startswith("char_cnn/") for node in nodes)
        assert (convs, products) == ((widths, 0) if "window" in file else (0, widths)), file
