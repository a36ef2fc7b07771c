"""The biLM as a language model (training.language_model), its pieces against plain formulas."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model_export.weights import random_bilm
from service.text.chars import token_char_ids
from training.language_model import BiLanguageModel, TokenTable, pad_batch
from training.trainer import load_config
from training.vocab import Vocabulary


def test_language_model_loss_is_the_sum_of_both_directions_log_likelihoods():
    """The loss against an explicit per-position computation: forward predicts the next word, backward the
    previous one, padding predicts nothing."""
    _, opt, _ = load_config("tiny")
    vocab = Vocabulary(["</S>", "<S>", "<UNK>", "cat", "dog", "sat"])
    model = BiLanguageModel(opt, len(vocab), dropout=0.0).eval()
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    table = TokenTable(vocab, opt.max_chars)
    sentences = [["cat", "sat"], ["dog", "unseen", "sat", "cat"]]
    rows = [table.encode(s) for s in sentences]
    chars, targets = table.tensors()
    with torch.no_grad():
        sums = model(pad_batch(rows), chars, targets)
    assert sums.predictions == sum(len(s) + 1 for s in sentences)
    want_f = want_b = 0.0
    for s, row in zip(sentences, rows, strict=True):
        batch = pad_batch([row])
        x = model.bilm.token_encoder(chars[batch[0]]).unsqueeze(0)
        with torch.no_grad():
            top_f = model.bilm.forward_lstm(x)[-1][0]
            top_b = model.bilm.backward_lstm(x.flip(1))[-1][0].flip(0)
            ids = [vocab.id(w) for w in ["<S>", *s, "</S>"]]
            for t in range(len(ids) - 1):
                want_f -= float(model.softmax.log_prob(top_f[t : t + 1])[0, ids[t + 1]])
                want_b -= float(model.softmax.log_prob(top_b[t + 1 : t + 2])[0, ids[t]])
    assert float(sums.forward) == pytest.approx(want_f, rel=1e-5)
    assert float(sums.backward) == pytest.approx(want_b, rel=1e-5)


def test_the_char_cnn_by_length_groups_equals_the_full_width_char_cnn():
    """Training convolves groups of short words over fewer char positions: the same vectors, to float rounding,
    for words of every length up to the 48 bytes kept (and the markers), in any order."""
    from training.language_model import token_vectors_by_length

    _, options, _ = load_config("small")
    bilm = random_bilm(options, seed=3)
    words = ["a", "of", "the", "river", "<S>", "</S>", "é" * 30, "x" * 60, "bank", "Pneumonoultramicroscopic"]
    words += [f"w{'o' * (i % 40)}rd" for i in range(40)]
    chars = torch.from_numpy(np.stack([token_char_ids(w, options.max_chars) for w in words]).astype(np.int64))
    with torch.no_grad():
        full = bilm.token_encoder(chars)
        grouped = token_vectors_by_length(bilm.token_encoder, chars)
    np.testing.assert_allclose(grouped.numpy(), full.numpy(), atol=1e-5, rtol=0)
    assert grouped.shape == full.shape
