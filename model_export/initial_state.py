"""The warm initial state: one fixed (h, c) per layer and direction, the same for every sentence.

The published biLM was trained statefully (each batch continued from the previous batch's final state), so the
zero state is off its training distribution; carrying state across requests would make one client's vectors
depend on another's. A fixed state computed once from a warm-up text is deterministic and per-sentence:
the mean, over the warm-up sentences, of the LSTM state each direction reaches at the end of a sentence
(after </S> going forward, after <S> going backward), which is where the stateful model started the next one.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
from torch import Tensor

from model_export.bilm import BiLM
from service.text.chars import sentence_char_ids

BATCH = 64


@torch.no_grad()
def mean_final_state(bilm: BiLM, sentences: list[list[str]]) -> list[tuple[Tensor, Tensor]]:
    """Mean final (h, c) per layer, forward stack's layers first, from the zero state (whatever bilm holds now)."""
    if not sentences:
        raise ValueError("the warm-up text has no sentences")
    was_training = bilm.training
    bilm.eval()
    saved = [(c.h0.clone(), c.c0.clone()) for c in [*bilm.forward_lstm.layers, *bilm.backward_lstm.layers]]
    bilm.set_initial_state(None)
    by_length = defaultdict(list)  # equal lengths: no padding, so the last step is every row's final state
    for s in sentences:
        by_length[len(s)].append(s)
    totals: list[list[Tensor]] | None = None
    for group in by_length.values():
        for start in range(0, len(group), BATCH):
            chunk = group[start : start + BATCH]
            chars = torch.from_numpy(np.stack([sentence_char_ids(s, bilm.options.max_chars) for s in chunk]))
            x = bilm.token_vectors(chars.long().to(bilm.token_encoder.char_embed.weight.device))
            states = bilm.forward_lstm.run(x)[1] + bilm.backward_lstm.run(x.flip(1))[1]
            flat = [v.sum(dim=0) for pair in states for v in pair]  # summed over the batch
            totals = flat if totals is None else [a + v for a, v in zip(totals, flat, strict=True)]
    bilm.set_initial_state(saved)
    bilm.train(was_training)
    means = [v / len(sentences) for v in totals]
    return [(means[2 * k], means[2 * k + 1]) for k in range(len(means) // 2)]
