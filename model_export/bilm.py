"""The ELMo biLM in PyTorch (Peters et al., 2018), the reference that the ONNX export must equal.

    chars (B, T, max_chars) -> CharCNN -> x (B, T, P)            token layer, shared by both directions
    x -> forward LSTM stack  -> f_1..f_L (B, T, P)
    x -> backward LSTM stack -> b_1..b_L (B, T, P)                runs right-to-left over each sentence
    layers = [[x; x], [f_1; b_1], ..., [f_L; b_L]]  (L+1, B, T, 2P)

Names follow the published weight files (TensorFlow's LSTMCell): gates in the order i, j, f, o, and a
forget bias of 1.0 added at run time. Stateless: every sentence starts from the same initial state
(zero unless an exported model sets a warm one), so a sentence's vectors never depend on other input.
Padding is kept behind each sentence in both directions, so it never reaches a real token.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from model_export.options import BiLMOptions

FORGET_BIAS = 1.0  # TensorFlow's LSTMCell adds this to the f gate; the published B does not include it


class CharCNN(nn.Module):
    """Context-independent token vectors from characters: embed, convolve, max-pool, highway, project."""

    def __init__(self, opt: BiLMOptions):
        super().__init__()
        self.activation = torch.relu if opt.activation == "relu" else torch.tanh
        self.char_embed = nn.Embedding(opt.char_vocab, opt.char_dim, padding_idx=0)
        self.convs = nn.ModuleList(nn.Conv1d(opt.char_dim, n, width) for width, n in opt.filters)
        # highway: [transform; carry] in one matmul; out = carry * relu(transform) + (1 - carry) * x
        self.highways = nn.ModuleList(nn.Linear(opt.n_filters, 2 * opt.n_filters) for _ in range(opt.n_highway))
        # ELMoForManyLangs: a word vector joins the char-CNN's before the projection (published models: none)
        self.word_embed = nn.Embedding(opt.word_vocab, opt.word_dim) if opt.word_dim else None
        self.proj = nn.Linear(opt.word_dim + opt.n_filters, opt.proj_dim)

    def forward(self, chars: Tensor) -> Tensor:
        """chars (N, max_chars) int, then a column of word ids (N, max_chars + 1) for a model with a word table
        -> token vectors (N, P)."""
        words = None
        if self.word_embed is not None:
            chars, words = chars[:, :-1], chars[:, -1]
        x = self.char_embed(chars).transpose(1, 2)  # (N, char_dim, max_chars)
        x = torch.cat([self.activation(conv(x).amax(dim=-1)) for conv in self.convs], dim=-1)  # (N, n_filters)
        for highway in self.highways:
            transform, carry = highway(x).chunk(2, dim=-1)
            carry = torch.sigmoid(carry)
            x = carry * torch.relu(transform) + (1.0 - carry) * x
        if words is not None:
            x = torch.cat([self.word_embed(words), x], dim=-1)  # (N, word_dim + n_filters)
        return self.proj(x)


class ProjectedLSTM(nn.Module):
    """One layer and direction: an LSTM with cell clipping and a clipped projection of its output."""

    def __init__(self, opt: BiLMOptions):
        super().__init__()
        p, c = opt.proj_dim, opt.cell_dim
        self.w_input = nn.Parameter(torch.zeros(p, 4 * c))  # rows of W_0 that multiply the input
        self.w_hidden = nn.Parameter(torch.zeros(p, 4 * c))  # rows of W_0 that multiply h_{t-1}
        self.bias = nn.Parameter(torch.zeros(4 * c))  # B
        self.w_proj = nn.Parameter(torch.zeros(c, p))  # W_P_0
        self.register_buffer("h0", torch.zeros(p))  # initial state (zero; a warm state if set at export)
        self.register_buffer("c0", torch.zeros(c))
        self.cell_clip = opt.cell_clip
        self.proj_clip = opt.proj_clip

    def forward(self, x: Tensor) -> Tensor:
        """x (B, T, P), real tokens first in each row -> h (B, T, P)."""
        return self.run(x)[0]

    def run(self, x: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x (B, T, P) -> h (B, T, P) and the state (h, c) after step T (the warm initial state is made of those)."""
        batch, steps, _ = x.shape
        gates_x = torch.addmm(self.bias, x.reshape(batch * steps, -1), self.w_input).view(batch, steps, -1)
        h = self.h0.expand(batch, -1)
        c = self.c0.expand(batch, -1)
        outputs = []
        for gates_t in gates_x.unbind(1):  # not gates_x[:, t]: its gradient would be a full-size tensor per step
            i, j, f, o = (gates_t + h @ self.w_hidden).chunk(4, dim=-1)
            c = torch.sigmoid(f + FORGET_BIAS) * c + torch.sigmoid(i) * torch.tanh(j)
            if self.cell_clip:
                c = c.clamp(-self.cell_clip, self.cell_clip)
            h = (torch.sigmoid(o) * torch.tanh(c)) @ self.w_proj
            if self.proj_clip:
                h = h.clamp(-self.proj_clip, self.proj_clip)
            outputs.append(h)
        return torch.stack(outputs, dim=1), (h, c)


class LSTMStack(nn.Module):
    """L projected LSTM layers in one direction; from layer 2 on, each adds its input to its output."""

    def __init__(self, opt: BiLMOptions, dropout: float = 0.0):
        super().__init__()
        self.layers = nn.ModuleList(ProjectedLSTM(opt) for _ in range(opt.n_layers))
        self.skip_connections = opt.skip_connections
        self.dropout = nn.Dropout(dropout)  # on each layer's input, in training only (elmo-train)

    def forward(self, x: Tensor) -> list[Tensor]:
        return self.run(x)[0]

    def run(self, x: Tensor) -> tuple[list[Tensor], list[tuple[Tensor, Tensor]]]:
        """x (B, T, P) -> each layer's output (B, T, P), and each layer's state (h, c) after step T."""
        outputs, states = [], []
        for k, layer in enumerate(self.layers):
            h, state = layer.run(self.dropout(x))
            x = h + x if self.skip_connections and k > 0 else h
            outputs.append(x)
            states.append(state)
        return outputs, states


def reverse_each(x: Tensor, lengths: Tensor) -> Tensor:
    """Reverse the first lengths[b] steps of every row of x (B, T, ...), leaving padding in place."""
    steps = torch.arange(x.shape[1], device=x.device).unsqueeze(0)  # (1, T)
    last = lengths.unsqueeze(1) - 1  # (B, 1)
    index = torch.where(steps <= last, last - steps, steps)  # (B, T)
    return x.gather(1, index.view(*index.shape, *([1] * (x.dim() - 2))).expand_as(x))


class BiLM(nn.Module):
    """The biLM: a shared char-CNN token layer and separate forward and backward LSTM stacks."""

    def __init__(self, opt: BiLMOptions, dropout: float = 0.0):
        super().__init__()
        self.options = opt
        self.token_encoder = CharCNN(opt)
        self.forward_lstm = LSTMStack(opt, dropout)
        self.backward_lstm = LSTMStack(opt, dropout)

    def contextualize(self, x: Tensor, lengths: Tensor) -> Tensor:
        """Token vectors x (B, T, P), lengths (B,) -> layers (L+1, B, T, 2P)."""
        forward = self.forward_lstm(x)
        backward = [reverse_each(h, lengths) for h in self.backward_lstm(reverse_each(x, lengths))]
        layers = [torch.cat([x, x], dim=-1)]
        layers += [torch.cat([f, b], dim=-1) for f, b in zip(forward, backward, strict=True)]
        return torch.stack(layers)

    def set_initial_state(self, states: list[tuple[Tensor, Tensor]] | None) -> None:
        """Every sentence's initial (h, c) per layer, forward stack's layers first then the backward stack's;
        None for the zero state."""
        cells = [*self.forward_lstm.layers, *self.backward_lstm.layers]
        with torch.no_grad():
            for k, cell in enumerate(cells):
                cell.h0.copy_(states[k][0] if states else torch.zeros_like(cell.h0))
                cell.c0.copy_(states[k][1] if states else torch.zeros_like(cell.c0))

    def forward(self, chars: Tensor, lengths: Tensor | None = None) -> Tensor:
        """chars (B, T, width) (`CharCNN.forward`'s rows), sentence boundaries included, rows of id 0 = padding
        (or `lengths` (B,) given) -> layers (L+1, B, T, 2P)."""
        if lengths is None:
            lengths = (chars > 0).any(dim=-1).sum(dim=1)
        return self.contextualize(self.token_vectors(chars), lengths)

    def token_vectors(self, chars: Tensor) -> Tensor:
        """chars (B, T, width) -> the token layer x (B, T, P)."""
        batch, steps, width = chars.shape
        return self.token_encoder(chars.reshape(batch * steps, width)).view(batch, steps, -1)
