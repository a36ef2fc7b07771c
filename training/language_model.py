"""The biLM as a language model, for training and for held-out perplexity (Peters et al., 2018, section 3.1).

    <S> w_1 ... w_n </S>  -> token layer x (char-CNN, once per distinct word of the batch)
    forward stack:  top output at position t   predicts the word at t + 1   (<S> .. w_n  ->  w_1 .. </S>)
    backward stack: top output at position t   predicts the word at t - 1   (w_1 .. </S> ->  <S> .. w_n)
    loss = -(sum of both directions' log-likelihoods); one softmax, shared by both directions.

Words outside the vocabulary are predicted as <UNK>, but still read through their characters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from model_export.bilm import BiLM, CharCNN, reverse_each
from model_export.options import BiLMOptions
from service.text.chars import PAD_CHAR, token_char_ids
from training.vocab import BOS, EOS, Vocabulary

PAD_ID = PAD_CHAR + 1  # the char id of the positions after a word's end marker
LENGTH_GROUPS = 4  # groups of words of similar length that the char-CNN convolves separately in training


class TokenTable:
    """Every distinct word of a corpus once, with its char ids and vocabulary id, so a sentence is a row of
    small ints and a batch runs the char-CNN once per distinct word."""

    def __init__(self, vocab: Vocabulary, max_chars: int):
        self.vocab, self.max_chars = vocab, max_chars
        self.ids: dict[str, int] = {}
        self._chars: list[np.ndarray] = []
        self._targets: list[int] = []
        for word in (BOS, EOS):
            self._add(word)

    def _add(self, word: str) -> int:
        self.ids[word] = len(self._chars)
        self._chars.append(token_char_ids(word, self.max_chars))
        self._targets.append(self.vocab.id(word))
        return self.ids[word]

    def encode(self, sentence: Sequence[str]) -> np.ndarray:
        """`<S> sentence </S>` as type ids, int32."""
        ids = [self.ids[w] if w in self.ids else self._add(w) for w in sentence]
        return np.array([self.ids[BOS], *ids, self.ids[EOS]], dtype=np.int32)

    def tensors(self) -> tuple[Tensor, Tensor]:
        """(chars (n_types, max_chars) int64, vocabulary ids (n_types,) int64)."""
        return torch.from_numpy(np.stack(self._chars).astype(np.int64)), torch.tensor(self._targets)


def pad_batch(rows: Sequence[np.ndarray]) -> Tensor:
    """Type-id rows -> (B, T) int64, -1 where a row has ended."""
    out = np.full((len(rows), max(len(r) for r in rows)), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return torch.from_numpy(out)


def token_vectors_by_length(encoder: CharCNN, chars: Tensor, groups: int = LENGTH_GROUPS) -> Tensor:
    """encoder(chars) for distinct words (N, max_chars) -> (N, P), computed in groups of words of similar length,
    each convolved over only the char positions its max-pool needs. Past a word's end marker every position holds
    the padding char, so every window there has the same value, and one of them is all the max-pool needs: a word
    of L chars (markers included) needs L + (widest filter) positions, not max_chars (50; most words need 15 to
    20). The same vectors up to float rounding, at a fraction of the char-CNN's cost (about 40% of a training
    step at full width)."""
    if encoder.word_embed is not None or len(chars) < groups:
        return encoder(chars)
    widest = max(conv.kernel_size[0] for conv in encoder.convs)
    need = ((chars != PAD_ID).sum(dim=1) + widest).clamp(max=chars.shape[1])
    order = torch.argsort(need)
    parts = [encoder(chars[part, : int(need[part].max())]) for part in order.tensor_split(groups)]
    return torch.cat(parts)[torch.argsort(order)]


@dataclass
class LossSums:
    forward: Tensor  # summed negative log-likelihood, forward direction
    backward: Tensor
    predictions: int  # per direction: n + 1 for a sentence of n words


def softmax_cutoffs(vocab_size: int) -> list[int]:
    """Frequency-rank boundaries of the adaptive softmax's clusters: the head holds the first 2,000 words."""
    return [c for c in (2000, 6000) if c < vocab_size - 1] or [vocab_size // 2]


class BiLanguageModel(nn.Module):
    def __init__(self, opt: BiLMOptions, vocab_size: int, dropout: float = 0.1):
        super().__init__()
        self.bilm = BiLM(opt, dropout)
        self.dropout = nn.Dropout(dropout)
        # Shared by both directions. Adaptive (Grave et al., 2017): the most frequent words in a full softmax,
        # rarer ones behind cluster tokens with smaller projections; exact probabilities at a fraction of the cost.
        self.softmax = nn.AdaptiveLogSoftmaxWithLoss(
            opt.proj_dim, vocab_size, softmax_cutoffs(vocab_size), div_value=4.0
        )

    def forward(self, batch: Tensor, type_chars: Tensor, type_targets: Tensor) -> LossSums:
        """batch (B, T) type ids, -1 = padding; type_chars / type_targets from TokenTable.tensors()."""
        (h_f, t_f), (h_b, t_b) = self.predictions(batch, type_chars)
        nll_f = self._nll(h_f, type_targets[t_f])
        nll_b = self._nll(h_b, type_targets[t_b])
        return LossSums(nll_f, nll_b, len(t_f))

    def predictions(self, batch: Tensor, type_chars: Tensor) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
        """batch (B, T) type ids, -1 = padding -> for each direction, (the top layer's output at every position
        that predicts a word (N, P), the type id of the word it predicts (N,))."""
        real = batch >= 0
        lengths = real.sum(dim=1)
        types, inverse = torch.unique(batch[real], return_inverse=True)
        vectors = token_vectors_by_length(self.bilm.token_encoder, type_chars[types])  # (U, P): once per word
        x = vectors.new_zeros(*batch.shape, vectors.shape[-1])
        x[real] = vectors[inverse]
        top_forward = self.bilm.forward_lstm(x)[-1]
        top_backward = reverse_each(self.bilm.backward_lstm(reverse_each(x, lengths))[-1], lengths)
        words = batch.clamp(min=0)
        valid = real[:, 1:]  # the target position is a real token (so is the source)
        forward = (top_forward[:, :-1][valid], words[:, 1:][valid])
        backward = (top_backward[:, 1:][valid], words[:, :-1][valid])
        return forward, backward

    def _nll(self, h: Tensor, targets: Tensor) -> Tensor:
        return -self.softmax(self.dropout(h), targets).output.sum()


@dataclass(frozen=True)
class Perplexity:
    forward: float
    backward: float
    predictions: int

    def as_dict(self) -> dict:
        return {"forward": round(self.forward, 2), "backward": round(self.backward, 2), "predictions": self.predictions}


@torch.no_grad()
def perplexity(
    model: BiLanguageModel, rows: Sequence[np.ndarray], table: TokenTable, batch_size: int = 128
) -> Perplexity:
    """Held-out perplexity of each direction: exp(mean negative log-likelihood per predicted word)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device  # in float32, whatever precision training ran in
    type_chars, type_targets = (t.to(device) for t in table.tensors())
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    nll_f = nll_b = 0.0
    count = 0
    for start in range(0, len(order), batch_size):
        batch = pad_batch([rows[i] for i in order[start : start + batch_size]]).to(device)
        sums = model(batch, type_chars, type_targets)
        nll_f += float(sums.forward)
        nll_b += float(sums.backward)
        count += sums.predictions
    model.train(was_training)
    return Perplexity(math.exp(nll_f / count), math.exp(nll_b / count), count)
