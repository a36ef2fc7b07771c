"""The published ELMo weight layout (bilm-tf's `weights.hdf5`), read and written in this one place.

    char_embed                                        (261, char_dim)   ids 1..261; id 0 is padding
    CNN/W_cnn_{i}, CNN/b_cnn_{i}                      (1, width, char_dim, n), (n,)
    CNN_high_{k}/W_transform, b_transform             (F, F), (F,)       x @ W, TensorFlow orientation
    CNN_high_{k}/W_carry, b_carry                     (F, F), (F,)
    CNN_proj/W_proj, b_proj                           (F, P), (P,)
    RNN_{d}/RNN/MultiRNNCell/Cell{l}/LSTMCell/W_0     (P + P, 4C)       rows: [input; h_{t-1}], gates i, j, f, o
                                            .../B     (4C,)             without the forget bias of 1.0
                                            .../W_P_0 (C, P)
d = 0 is the forward and d = 1 the backward direction; l counts layers from 0.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import torch

from model_export.bilm import BiLM, ProjectedLSTM
from model_export.options import BiLMOptions, load_options


def _cell_name(direction: int, layer: int) -> str:
    return f"RNN_{direction}/RNN/MultiRNNCell/Cell{layer}/LSTMCell"


def _published_arrays(model: BiLM) -> dict[str, np.ndarray]:
    """Every dataset of the published file, computed from the model's parameters."""

    def a(t: torch.Tensor) -> np.ndarray:
        return t.detach().cpu().numpy().astype(np.float32)

    enc = model.token_encoder
    out = {"char_embed": a(enc.char_embed.weight[1:])}
    for i, conv in enumerate(enc.convs):
        # torch (n, char_dim, width) -> published (1, width, char_dim, n)
        out[f"CNN/W_cnn_{i}"] = a(conv.weight.permute(2, 1, 0).unsqueeze(0))
        out[f"CNN/b_cnn_{i}"] = a(conv.bias)
    for k, highway in enumerate(enc.highways):
        transform, carry = highway.weight.chunk(2, dim=0)
        b_transform, b_carry = highway.bias.chunk(2)
        out[f"CNN_high_{k}/W_transform"] = a(transform.T)
        out[f"CNN_high_{k}/b_transform"] = a(b_transform)
        out[f"CNN_high_{k}/W_carry"] = a(carry.T)
        out[f"CNN_high_{k}/b_carry"] = a(b_carry)
    out["CNN_proj/W_proj"] = a(enc.proj.weight.T)
    out["CNN_proj/b_proj"] = a(enc.proj.bias)
    for d, stack in enumerate((model.forward_lstm, model.backward_lstm)):
        for layer_index, layer in enumerate(stack.layers):
            name = _cell_name(d, layer_index)
            out[f"{name}/W_0"] = a(torch.cat([layer.w_input, layer.w_hidden]))
            out[f"{name}/B"] = a(layer.bias)
            out[f"{name}/W_P_0"] = a(layer.w_proj)
    return out


def _assign(param: torch.Tensor, value: np.ndarray, name: str) -> None:
    if tuple(param.shape) != value.shape:
        raise ValueError(f"{name}: shape {value.shape} in the weight file, {tuple(param.shape)} in options.json")
    with torch.no_grad():
        param.copy_(torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32)))


def load_published_weights(model: BiLM, path: str | Path) -> None:
    """Fill `model` from a published-layout `weights.hdf5`; shapes must match its options."""
    enc = model.token_encoder
    with h5py.File(path, "r") as f:

        def get(name: str) -> np.ndarray:
            if name not in f:
                raise ValueError(f"{path}: dataset {name!r} is missing (not a published ELMo weight file?)")
            return f[name][...]

        char_embed = get("char_embed")
        table = np.zeros(tuple(enc.char_embed.weight.shape), dtype=np.float32)
        table[1 : 1 + len(char_embed)] = char_embed
        _assign(enc.char_embed.weight, table, "char_embed")
        for i, conv in enumerate(enc.convs):
            _assign(conv.weight, get(f"CNN/W_cnn_{i}")[0].transpose(2, 1, 0), f"CNN/W_cnn_{i}")
            _assign(conv.bias, get(f"CNN/b_cnn_{i}"), f"CNN/b_cnn_{i}")
        for k, highway in enumerate(enc.highways):
            g = f"CNN_high_{k}"
            weight = np.concatenate([get(f"{g}/W_transform").T, get(f"{g}/W_carry").T])
            bias = np.concatenate([get(f"{g}/b_transform"), get(f"{g}/b_carry")])
            _assign(highway.weight, weight, f"{g}/W_transform+W_carry")
            _assign(highway.bias, bias, f"{g}/b_transform+b_carry")
        _assign(enc.proj.weight, get("CNN_proj/W_proj").T, "CNN_proj/W_proj")
        _assign(enc.proj.bias, get("CNN_proj/b_proj"), "CNN_proj/b_proj")
        for d, stack in enumerate((model.forward_lstm, model.backward_lstm)):
            for layer_index, layer in enumerate(stack.layers):
                _load_cell(layer, _cell_name(d, layer_index), get)


def _load_cell(layer: ProjectedLSTM, name: str, get) -> None:
    w0 = get(f"{name}/W_0")
    n_input = layer.w_input.shape[0]
    _assign(layer.w_input, w0[:n_input], f"{name}/W_0")
    _assign(layer.w_hidden, w0[n_input:], f"{name}/W_0")
    _assign(layer.bias, get(f"{name}/B"), f"{name}/B")
    _assign(layer.w_proj, get(f"{name}/W_P_0"), f"{name}/W_P_0")


def write_published_weights(model: BiLM, path: str | Path) -> None:
    """Write `model` as a published-layout `weights.hdf5` that bilm-tf and allennlp load unchanged."""
    with h5py.File(path, "w") as f:
        for name, value in _published_arrays(model).items():
            f.create_dataset(name, data=value)


def load_bilm(options_path: str | Path, weights_path: str | Path) -> BiLM:
    """The biLM of a published `options.json` + `weights.hdf5`, in eval mode."""
    model = BiLM(load_options(options_path))
    load_published_weights(model, weights_path)
    return model.eval()


def random_bilm(opt: BiLMOptions, seed: int = 0, gain: float = 1.0) -> BiLM:
    """A biLM of the given shape with random weights (benchmarks, and tests of shapes without a fixture).

    Each matrix gets std gain / sqrt(fan_in), so activations stay of order 1 and the recurrence is stable:
    with much larger weights a random LSTM turns chaotic and float rounding grows along the sentence.
    """
    gen = torch.Generator().manual_seed(seed)
    model = BiLM(opt)
    fan_in = {"w_input": opt.proj_dim, "w_hidden": opt.proj_dim, "w_proj": opt.cell_dim}
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in fan_in:
                std = gain / fan_in[leaf] ** 0.5
            elif leaf == "weight" and param.dim() > 1 and "char_embed" not in name:
                std = gain / (param[0].numel()) ** 0.5  # torch layout: (out, in...) -> fan_in
            else:
                std = 0.1 if "bias" in leaf else 1.0  # biases; char embeddings
            param.copy_(torch.randn(param.shape, generator=gen) * std)
        model.token_encoder.char_embed.weight[0].zero_()
    return model.eval()
