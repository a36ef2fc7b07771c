"""The warm initial state: computed as documented, exported exactly, the same for every sentence of every batch."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from model_export.export import export_published, torch_layers
from model_export.initial_state import mean_final_state
from model_export.weights import load_bilm
from service.engine.session import Engine
from service.text.chars import sentence_char_ids
from tests.conftest import max_error

# Lengths 7, 5, 6, 1, and 70 sentences of length 3: groups of one, and a group larger than a batch of 64.
WARMUP = ["The cat sat on the mat .", "A bank by the river", "Colorless green ideas sleep furiously .", "Hello"]
WARMUP += [f"word{i} and more" for i in range(70)]


@pytest.fixture(scope="module")
def warmup_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("warmup") / "warmup.txt"
    path.write_text("\n".join(WARMUP) + "\n\n")
    return path


@pytest.fixture(scope="module")
def warm_dir(tiny_dir, warmup_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("warm-onnx")
    export_published(tiny_dir / "options.json", tiny_dir / "lm_weights.hdf5", out, warmup_text=warmup_file)
    return out


def test_mean_final_state_is_the_mean_of_each_sentences_last_state(tiny_bilm):
    """Against a direct computation: each sentence alone, each layer's state after its last step
    (after </S> forward, after <S> backward), averaged."""
    sentences = [s.split() for s in WARMUP]
    got = mean_final_state(tiny_bilm, sentences)
    stacks = (tiny_bilm.forward_lstm, tiny_bilm.backward_lstm)
    want = [[torch.zeros_like(t) for t in pair] for pair in got]
    with torch.no_grad():
        for s in sentences:
            chars = torch.from_numpy(sentence_char_ids(s)).long()
            x0 = tiny_bilm.token_encoder(chars).unsqueeze(0)
            for d, stack in enumerate(stacks):
                x = x0 if d == 0 else x0.flip(1)
                for k, layer in enumerate(stack.layers):
                    h, (h_last, c_last) = layer.run(x)
                    np.testing.assert_array_equal(h_last[0].numpy(), h[0, -1].numpy())
                    index = d * len(stack.layers) + k
                    want[index][0] += h_last[0] / len(sentences)
                    want[index][1] += c_last[0] / len(sentences)
                    x = h + x if k > 0 else h
    for (h, c), (wh, wc) in zip(got, want, strict=True):
        np.testing.assert_allclose(h.numpy(), wh.numpy(), atol=1e-5)  # float32 sums in another order
        np.testing.assert_allclose(c.numpy(), wc.numpy(), atol=1e-5)
    assert all(float(h.abs().max()) > 1e-3 for h, _ in got)  # not the zero state
    assert float(tiny_bilm.forward_lstm.layers[0].h0.abs().max()) == 0  # and the model was left as it was


def test_warm_export_equals_torch_with_the_warm_state(warm_dir, tiny_dir, warmup_file, sentences):
    manifest = json.loads((warm_dir / "manifest.json").read_text())
    assert manifest["initial_state"] == "warm" and manifest["parity"]["max_abs_error"] <= 1e-5
    assert len(manifest["sources"]["warmup_text"]["sha256"]) == 64
    model = load_bilm(tiny_dir / "options.json", tiny_dir / "lm_weights.hdf5")
    model.set_initial_state(mean_final_state(model, [s.split() for s in WARMUP]))
    engine = Engine(warm_dir, provider="cpu")
    assert max_error(engine.run(sentences), torch_layers(model, sentences)) <= 1e-5


def test_warm_state_changes_the_context_layers_only(warm_dir, engine, sentences):
    warm, zero = Engine(warm_dir, provider="cpu").run(sentences[:3]), engine.run(sentences[:3])
    for w, z in zip(warm, zero, strict=True):
        np.testing.assert_array_equal(w[0], z[0])  # the token layer has no state
        assert np.abs(w[1:] - z[1:]).max() > 1e-3


def test_warm_state_is_the_same_for_every_sentence_in_any_batch(warm_dir, sentences):
    engine = Engine(warm_dir, provider="cpu")
    alone = [engine.run([s])[0] for s in sentences[:4]]
    together = engine.run([sentences[3], ["x"] * 200, *sentences[:3]])
    again = engine.run(sentences[:4])
    position = {3: 0, 0: 2, 1: 3, 2: 4}  # where each sentence sits in `together`
    for i in range(4):
        assert np.abs(together[position[i]] - alone[i]).max() <= 1e-6
        np.testing.assert_array_equal(again[i], alone[i])


def test_cli_needs_warmup_text_with_warm(tiny_dir, tmp_path, warmup_file):
    base = [sys.executable, "-m", "model_export.cli", "--options", str(tiny_dir / "options.json"),
            "--weights", str(tiny_dir / "lm_weights.hdf5"), "--out", str(tmp_path / "m")]  # fmt: skip
    bad = subprocess.run([*base, "--initial-state", "warm"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--warmup-text" in bad.stderr
    ok = subprocess.run(
        [*base, "--initial-state", "warm", "--warmup-text", str(warmup_file)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr
    assert "warm initial state" in ok.stdout
