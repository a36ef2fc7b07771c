"""What the API computes from a sentence's layers h_j (num_layers, n_tokens, dim): the scalar mix
    gamma * sum_j w_j * h_j,  w = softmax(s) (the paper's mix) or s as given,
optionally with each layer normalized first, mean pooling over tokens, and unit-length vectors last."""

from __future__ import annotations

import numpy as np

LAYER_NORM_EPS = 1e-12
UNIT_LENGTH_EPS = 1e-12  # the norm's floor, as torch.nn.functional.normalize has it: a zero vector stays zero


def layer_norm(layers: np.ndarray) -> np.ndarray:
    """Normalize each layer over this sentence's tokens and dims (mean 0, variance 1)."""
    mean = layers.mean(axis=(1, 2), keepdims=True)
    var = ((layers - mean) ** 2).mean(axis=(1, 2), keepdims=True)
    return (layers - mean) / np.sqrt(var + LAYER_NORM_EPS)


def mix_weights(weights: list[float], normalize: str) -> np.ndarray:
    s = np.asarray(weights, dtype=np.float64)
    if normalize == "softmax":
        e = np.exp(s - s.max())
        return e / e.sum()
    return s


def scalar_mix(
    layers: np.ndarray, weights: list[float], gamma: float = 1.0, normalize: str = "softmax", norm: bool = False
) -> np.ndarray:
    """(num_layers, n_tokens, dim) -> (n_tokens, dim) float32, computed in float64."""
    layers = layers.astype(np.float64)
    if norm:
        layers = layer_norm(layers)
    w = mix_weights(weights, normalize) * gamma
    return np.tensordot(w, layers, axes=1).astype(np.float32)


def mean_pool(x: np.ndarray) -> np.ndarray:
    """Average over the token axis (the one before the last)."""
    return x.mean(axis=-2, dtype=np.float32)


def unit_length(x: np.ndarray) -> np.ndarray:
    """Every vector (the last axis) divided by its L2 norm, computed in float64, returned as float32."""
    x = x.astype(np.float64)
    norm = np.sqrt((x * x).sum(axis=-1, keepdims=True))
    return (x / np.maximum(norm, UNIT_LENGTH_EPS)).astype(np.float32)


def compose(
    layers: np.ndarray,
    output: str,
    layer_ids: list[int] | None,
    mixes: list[tuple[list[float], float, str, bool]],
    pooling: str,
    single_mix: bool,
    unit: bool = False,
) -> np.ndarray:
    """One sentence's answer from its layers (num_layers, n_tokens, dim):
    output "layers" -> (len(layer_ids), n_tokens, dim); a mix -> (n_tokens, dim); several -> (n_mixes, n_tokens, dim);
    mean pooling drops the token axis; `unit` scales every vector of the answer to length 1, last (so a pooled
    vector is the unit-length mean, not the mean of unit vectors)."""
    if output == "layers":
        out = layers if layer_ids is None else layers[layer_ids]
    else:
        out = np.stack([scalar_mix(layers, w, g, n, ln) for w, g, n, ln in mixes])
        if single_mix:
            out = out[0]
    out = mean_pool(out) if pooling == "mean" else out
    return unit_length(out) if unit else out
