"""The scalar mix, layer norm and pooling against a plain float64 formula written here, independently."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from service.mix import compose, layer_norm, mean_pool, mix_weights, scalar_mix, unit_length

RTOL = 1e-5
FLOAT32_TINY = 1e-35  # below float32's smallest normal: the result's own rounding, whatever the scale

SETTINGS = settings(max_examples=200, deadline=None)


# ---- the reference: one layer, one token, one weight at a time, in Python floats ----


def ref_weights(weights: list[float], normalize: str) -> list[float]:
    if normalize == "none":
        return [float(s) for s in weights]
    top = max(weights)
    e = [math.exp(s - top) for s in weights]
    total = math.fsum(e)
    return [x / total for x in e]


def ref_normalize(layer: np.ndarray) -> np.ndarray:
    """(n_tokens, dim) -> the same over all its tokens and dims: mean 0, population variance 1."""
    h = layer.astype(np.float64)
    values = h.ravel().tolist()
    mean = math.fsum(values) / len(values)
    var = math.fsum((x - mean) ** 2 for x in values) / len(values)
    return (h - mean) / math.sqrt(var + 1e-12)


def ref_mix(layers: np.ndarray, weights: list[float], gamma: float, normalize: str, norm: bool) -> np.ndarray:
    hs = [ref_normalize(h) if norm else h.astype(np.float64) for h in layers]
    w = ref_weights(weights, normalize)
    out = np.zeros(layers.shape[1:], dtype=np.float64)
    for wj, hj in zip(w, hs, strict=True):
        out += wj * hj
    return gamma * out


def mix_scale(layers: np.ndarray, weights: list[float], gamma: float, normalize: str, norm: bool) -> float:
    """An upper bound on the terms summed: float32 rounding of the result is relative to this."""
    hs = [ref_normalize(h) if norm else h.astype(np.float64) for h in layers]
    w = ref_weights(weights, normalize)
    return abs(gamma) * sum(abs(wj) * float(np.abs(hj).max()) for wj, hj in zip(w, hs, strict=True))


def assert_close(got: np.ndarray, want: np.ndarray, scale: float) -> None:
    assert got.dtype == np.float32
    assert got.shape == want.shape
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=RTOL, atol=RTOL * scale + FLOAT32_TINY)


# ---- strategies ----

values = st.floats(-100, 100, allow_nan=False, allow_infinity=False, width=32)
shapes = st.tuples(st.integers(1, 4), st.integers(1, 20), st.integers(1, 16))
layer_arrays = shapes.flatmap(lambda shape: arrays(np.float32, shape, elements=values))
weight_values = st.floats(-20, 20, allow_nan=False, allow_infinity=False)
gammas = st.floats(-10, 10, allow_nan=False, allow_infinity=False)
normalizes = st.sampled_from(["softmax", "none"])


@st.composite
def mix_cases(draw):
    layers = draw(layer_arrays)
    weights = draw(st.lists(weight_values, min_size=len(layers), max_size=len(layers)))
    return layers, weights, draw(gammas), draw(normalizes), draw(st.booleans())


# ---- scalar mix ----


@SETTINGS
@given(mix_cases())
def test_scalar_mix_matches_the_formula(case):
    layers, weights, gamma, normalize, norm = case
    before = layers.copy()
    got = scalar_mix(layers, weights, gamma, normalize, norm)
    assert got.shape == layers.shape[1:]
    assert_close(
        got, ref_mix(layers, weights, gamma, normalize, norm), mix_scale(layers, weights, gamma, normalize, norm)
    )
    np.testing.assert_array_equal(layers, before)  # the input is not touched


@SETTINGS
@given(mix_cases())
def test_mix_weights_are_softmax_or_as_given(case):
    _, weights, _, normalize, _ = case
    w = mix_weights(weights, normalize)
    np.testing.assert_allclose(w, ref_weights(weights, normalize), rtol=1e-12, atol=1e-300)
    if normalize == "softmax":
        assert (w >= 0).all()
        assert math.isclose(float(w.sum()), 1.0, rel_tol=1e-12)


@SETTINGS
@given(layer_arrays)
def test_layer_norm_matches_the_formula(layers):
    got = layer_norm(layers.astype(np.float64))
    want = np.stack([ref_normalize(h) for h in layers])
    assert got.shape == layers.shape
    # Normalized values are at most sqrt(n_tokens * dim) <= 18 in size.
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


def test_default_mix_is_the_mean_of_the_layers():
    layers = np.arange(3 * 2 * 4, dtype=np.float32).reshape(3, 2, 4)
    np.testing.assert_allclose(scalar_mix(layers, [0.0, 0.0, 0.0]), layers.mean(axis=0), rtol=1e-6)


def test_softmax_of_huge_weights_stays_finite():
    w = mix_weights([1000.0, 0.0, -1000.0], "softmax")
    assert np.isfinite(w).all()
    np.testing.assert_array_equal(w, [1.0, 0.0, 0.0])
    layers = np.random.default_rng(0).uniform(-5, 5, size=(3, 4, 6)).astype(np.float32)
    for gamma in (1.0, -2.5):
        got = scalar_mix(layers, [1000.0, 0.0, -1000.0], gamma, "softmax", False)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, gamma * layers[0].astype(np.float64), rtol=1e-6)
    # All equal and huge: still the plain average.
    np.testing.assert_allclose(mix_weights([1e6, 1e6], "softmax"), [0.5, 0.5])


@pytest.mark.parametrize("value", [0.0, 0.1, 3.7, -100.0, 1e-30])
def test_layer_norm_of_a_constant_layer_is_zero(value):
    layers = np.full((2, 3, 5), value, dtype=np.float32)
    got = layer_norm(layers.astype(np.float64))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, 0.0, atol=1e-6)
    mixed = scalar_mix(layers, [0.3, -1.0], 4.0, "softmax", norm=True)
    assert np.isfinite(mixed).all()
    np.testing.assert_allclose(mixed, 0.0, atol=1e-6)


def test_single_token_single_dim_layer_norm_is_zero():
    got = scalar_mix(np.array([[[7.0]], [[-3.0]]], dtype=np.float32), [0.0, 0.0], 1.0, "softmax", norm=True)
    assert got.shape == (1, 1)
    assert got[0, 0] == 0.0


# ---- pooling ----


@SETTINGS
@given(layer_arrays)
def test_mean_pool_averages_over_tokens(x):
    for arr in (x, x[0]):  # (L, n, D) and (n, D)
        got = mean_pool(arr)
        want = arr.astype(np.float64).mean(axis=-2)
        scale = float(np.abs(arr).max(initial=0.0))
        assert got.shape == arr.shape[:-2] + arr.shape[-1:]
        assert_close(got, want, scale)


# ---- compose ----


@st.composite
def compose_cases(draw):
    layers = draw(layer_arrays)
    num_layers = len(layers)
    output = draw(st.sampled_from(["mix", "layers"]))
    layer_ids = draw(st.none() | st.lists(st.integers(0, num_layers - 1), min_size=1, max_size=6))
    mix = st.tuples(
        st.lists(weight_values, min_size=num_layers, max_size=num_layers), gammas, normalizes, st.booleans()
    )
    mixes = draw(st.lists(mix, min_size=1, max_size=4))
    single_mix = len(mixes) == 1 and draw(st.booleans())
    pooling = draw(st.sampled_from(["none", "mean"]))
    return layers, output, layer_ids, mixes, pooling, single_mix


@SETTINGS
@given(compose_cases())
def test_compose_shapes_and_values(case):
    layers, output, layer_ids, mixes, pooling, single_mix = case
    num_layers, n_tokens, dim = layers.shape
    got = compose(layers, output, layer_ids, mixes, pooling, single_mix)
    assert got.dtype == np.float32

    if output == "layers":
        ids = list(range(num_layers)) if layer_ids is None else layer_ids
        want = np.stack([layers[j].astype(np.float64) for j in ids])  # selection and order as asked
        scale = float(np.abs(layers).max())
    else:
        want = np.stack([ref_mix(layers, w, g, n, ln) for w, g, n, ln in mixes])
        scale = max(mix_scale(layers, w, g, n, ln) for w, g, n, ln in mixes)
        if single_mix:
            want = want[0]
    if pooling == "mean":
        want = want.mean(axis=-2)

    if output == "layers":
        expected_shape = (len(ids), n_tokens, dim)
    elif single_mix:
        expected_shape = (n_tokens, dim)
    else:
        expected_shape = (len(mixes), n_tokens, dim)
    if pooling == "mean":
        expected_shape = (*expected_shape[:-2], dim)
    assert got.shape == expected_shape
    assert_close(got, want, scale)


def test_compose_layers_keeps_exact_values_and_order():
    layers = np.random.default_rng(1).standard_normal((3, 4, 5)).astype(np.float32)
    np.testing.assert_array_equal(compose(layers, "layers", [2, 0], [], "none", False), layers[[2, 0]])
    np.testing.assert_array_equal(compose(layers, "layers", None, [], "none", False), layers)
    assert compose(layers, "layers", [1], [], "mean", False).shape == (1, 5)


def test_compose_mix_shapes():
    layers = np.ones((3, 4, 5), dtype=np.float32)
    mix = ([0.0, 0.0, 0.0], 1.0, "softmax", False)
    assert compose(layers, "mix", None, [mix], "none", True).shape == (4, 5)
    assert compose(layers, "mix", None, [mix], "none", False).shape == (1, 4, 5)
    assert compose(layers, "mix", None, [mix, mix], "none", False).shape == (2, 4, 5)
    assert compose(layers, "mix", None, [mix], "mean", True).shape == (5,)
    assert compose(layers, "mix", None, [mix, mix], "mean", False).shape == (2, 5)


# ---- unit length ----


@SETTINGS
@given(layer_arrays)
def test_unit_length_divides_each_vector_by_its_norm(x):
    got = unit_length(x)
    assert got.dtype == np.float32 and got.shape == x.shape
    x64 = x.astype(np.float64)
    norms = np.sqrt((x64 * x64).sum(axis=-1, keepdims=True))
    assert_close(got, x64 / np.maximum(norms, 1e-12), 1.0)  # the floor: torch.nn.functional.normalize's
    big = norms[..., 0] > 1e-6
    np.testing.assert_allclose(np.linalg.norm(got.astype(np.float64), axis=-1)[big], 1.0, atol=1e-6)


def test_unit_length_keeps_a_zero_vector_zero_and_comes_last_in_compose():
    np.testing.assert_array_equal(unit_length(np.zeros((2, 3), np.float32)), np.zeros((2, 3), np.float32))
    layers = np.random.default_rng(2).standard_normal((3, 4, 5)).astype(np.float32)
    mix = ([0.0, 1.0, 2.0], 1.5, "softmax", False)
    pooled = compose(layers, "mix", None, [mix], "mean", True, unit=True)
    np.testing.assert_allclose(pooled, unit_length(compose(layers, "mix", None, [mix], "mean", True)), atol=1e-7)
    per_layer = compose(layers, "layers", None, [], "none", False, unit=True)
    np.testing.assert_allclose(np.linalg.norm(per_layer, axis=-1), np.ones((3, 4)), atol=1e-6)
