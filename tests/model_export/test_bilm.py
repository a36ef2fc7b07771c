"""The PyTorch biLM against the outputs of allennlp and of the original TensorFlow code."""

import h5py
import numpy as np
import pytest
import torch

from model_export.export import torch_layers
from service.text.chars import token_char_ids
from tests.conftest import max_error


def test_all_layers_of_all_sentences_match_allennlp(tiny_bilm, sentences, expected):
    assert max_error(torch_layers(tiny_bilm, sentences), expected) <= 1e-5


@pytest.mark.parametrize("k", [0, 1, 2])
def test_top_layer_matches_tensorflow(tiny_bilm, tiny_dir, sentences, k):
    # Only batch 0 of each file started from a zero state (the fixture README).
    with h5py.File(tiny_dir / f"lm_embeddings_{k}.hdf5", "r") as f:
        want = f["0"][...]  # (2 directions, n_tokens, 16)
    top = torch_layers(tiny_bilm, [sentences[10 * k]])[0][-1]
    assert np.abs(top - np.concatenate([want[0], want[1]], axis=-1)).max() <= 1e-5


def test_token_layer_matches_tensorflow(tiny_bilm, tiny_dir):
    words = (tiny_dir / "vocab_test.txt").read_text().split("\n")
    with h5py.File(tiny_dir / "elmo_token_embeddings.hdf5", "r") as f:
        want = f["embedding"][...]
    assert len(words) == len(want)
    chars = torch.from_numpy(np.stack([token_char_ids(w) for w in words]).astype(np.int64))
    with torch.no_grad():
        got = tiny_bilm.token_encoder(chars).numpy()
    assert np.abs(got - want).max() <= 1e-5


def test_layer_zero_is_token_vector_twice(tiny_bilm, sentences):
    layers = torch_layers(tiny_bilm, sentences[:1])[0]
    half = layers.shape[-1] // 2
    np.testing.assert_array_equal(layers[0, :, :half], layers[0, :, half:])


def test_stateless_and_batch_invariant(tiny_bilm, sentences):
    alone = torch_layers(tiny_bilm, [sentences[3]])[0]
    long = [f"w{i}" for i in range(300)]
    for batch in ([long, sentences[3]], [sentences[3], long], [sentences[0], sentences[3]]):
        batched = torch_layers(tiny_bilm, batch)[batch.index(sentences[3])]
        assert np.abs(batched - alone).max() <= 1e-6
    again = torch_layers(tiny_bilm, [sentences[3]])[0]  # no state carried from earlier calls
    np.testing.assert_array_equal(again, alone)
