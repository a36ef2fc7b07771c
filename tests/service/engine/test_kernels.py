"""This project's ONNX Runtime kernels (service/engine/native/ops.cc) against their ops' own definitions in
standard ONNX ops (model_export.onnx_graph: cell_function, quantize_function), which ONNX Runtime runs where no
kernel is registered; and the engines that use them."""

from functools import partial

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from model_export.onnx_graph import (
    CELL_DOMAIN,
    CELL_OP,
    IR_VERSION,
    OPSET,
    QUANTIZE_OP,
    SCALED_CELL_OP,
    cell_function,
    quantize_function,
)
from service.engine.native import library
from service.engine.providers import session_options
from service.engine.session import Engine

F32, I64 = TensorProto.FLOAT, TensorProto.INT64
INPUTS = [("gates_x", F32), ("first", I64), ("last", I64), ("gates_h", F32), ("bias", F32), ("c", F32), ("sizes", I64)]
SCALES = [("scale_x", F32), ("scale_h", F32)]  # SCALED_CELL_OP's two more


def one_node(
    op: str, inputs: list, outputs: list, function, kernel: bool, profile: bool = True, **attributes
) -> ort.InferenceSession:
    """A model of one node of this project's `op` (and the op's function), run by the kernel or by the function's
    ops; `inputs`, `outputs`: (name, element type); `profile`: for `ran` (which ends the profile and reads it)."""
    node = helper.make_node(op, [n for n, _ in inputs], [n for n, _ in outputs], domain=CELL_DOMAIN, **attributes)
    graph = helper.make_graph(
        [node], "one_node", [helper.make_tensor_value_info(n, t, None) for n, t in inputs],
        [helper.make_tensor_value_info(n, t, None) for n, t in outputs],
    )  # fmt: skip
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(CELL_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets, functions=[function])
    model.ir_version = IR_VERSION
    options = session_options(1, 1, kernels=kernel)
    options.enable_profiling = profile  # to tell which ran the step
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def one_step(cell_clip: float, kernel: bool, scaled: bool = False, profile: bool = True) -> ort.InferenceSession:
    outputs = [("c_next", F32), ("m", F32)]
    op, inputs = (SCALED_CELL_OP, INPUTS + SCALES) if scaled else (CELL_OP, INPUTS)
    return one_node(op, inputs, outputs, cell_function(cell_clip, scaled), kernel, profile, cell_clip=cell_clip)


def ran(session: ort.InferenceSession, feeds: dict) -> tuple[list[np.ndarray], set[str]]:
    """The session's outputs for `feeds`, and the op types its profile shows."""
    import json
    from pathlib import Path

    outputs = session.run(None, feeds)
    path = Path(session.end_profiling())
    ops = {e["args"].get("op_name") for e in json.loads(path.read_text()) if e.get("cat") == "Node"}
    path.unlink()
    return outputs, ops


def step_feeds(rng, total: int, first: int, rows: int, cell: int, scale: float, done: int = 2,
               scaled: bool = False) -> dict:  # fmt: skip
    """A step's inputs: `rows` running rows, `done` finished ones after them in the state; `scaled`: and the
    products' rows' scales (SCALED_CELL_OP's), each row's own, from 1/400 to 4."""
    feeds = {
        "gates_x": (rng.standard_normal((total, 4 * cell)) * scale).astype(np.float32),
        "first": np.array([first], np.int64),
        "last": np.array([first + rows], np.int64),
        "gates_h": (rng.standard_normal((rows, 4 * cell)) * scale).astype(np.float32),
        "bias": rng.standard_normal(4 * cell).astype(np.float32),
        "c": (rng.standard_normal((rows + done, cell)) * 4).astype(np.float32),  # past the clip of 3 in places
        "sizes": np.array([rows, done], np.int64),
    }
    if scaled:
        feeds["scale_x"] = rng.uniform(0.0025, 4, (total, 1)).astype(np.float32)
        feeds["scale_h"] = rng.uniform(0.0025, 4, (rows, 1)).astype(np.float32)
    return feeds


def test_the_install_built_the_kernel():
    # pip builds it where it finds a C++ compiler (pyproject.toml's ext-modules), as `make test`'s install does
    found = library()
    assert found is not None and found.is_file()


@pytest.mark.parametrize("scaled", [False, True], ids=["step", "scaled-step"])
@pytest.mark.parametrize("cell_clip", [3.0, 0.0])
@pytest.mark.parametrize(
    ("total", "first", "rows", "cell", "scale"),
    [
        (9, 2, 5, 64, 4.0),  # rows in the middle of the packed positions
        (5, 4, 1, 37, 4.0),  # one row; a width no vector divides: the loop's remainder
        (3, 0, 3, 4096, 4.0),  # the published cell width
        (4, 1, 2, 48, 60.0),  # gates far past where the sigmoid and tanh saturate (and exp's clamp)
        (4, 2, 0, 16, 1.0),  # no rows
    ],
)
def test_the_kernel_computes_what_the_ops_do(total, first, rows, cell, scale, cell_clip, scaled):
    feeds = step_feeds(np.random.default_rng(rows * 1000 + cell), total, first, rows, cell, scale, scaled=scaled)
    if scaled:  # products as large as the unscaled test's once their rows' scales are in
        feeds["gates_x"] /= feeds["scale_x"]
        feeds["gates_h"] /= feeds["scale_h"]
    op = SCALED_CELL_OP if scaled else CELL_OP
    (c_ops, m_ops), ops = ran(one_step(cell_clip, kernel=False, scaled=scaled), feeds)
    (c_kernel, m_kernel), kernel = ran(one_step(cell_clip, kernel=True, scaled=scaled), feeds)
    assert op not in ops and {"Slice", "Split", "Sigmoid", "Tanh"} <= ops  # the function, inlined
    assert kernel == {op}
    assert c_kernel.shape == c_ops.shape == (rows + 2, cell) and m_kernel.shape == m_ops.shape == (rows, cell)
    np.testing.assert_array_equal(c_kernel[rows:], feeds["c"][rows:])  # the finished rows' state, kept
    # relative to float's epsilon: the kernel's exp is a polynomial, ONNX Runtime's Sigmoid and Tanh its own
    np.testing.assert_allclose(c_kernel, c_ops, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(m_kernel, m_ops, rtol=2e-6, atol=2e-6)
    if cell_clip and rows:
        assert np.abs(c_kernel[:rows]).max() <= cell_clip and np.isclose(np.abs(c_kernel[:rows]).max(), cell_clip)


def test_the_scaled_step_rounds_each_product_before_its_sum_as_the_ops_do():
    # Mul then Add in the ops; an FMA (one rounding) in a compiled x * scale + bias drifts an ulp of that partial
    # sum, near 100 before it cancels against h * scale, which showed as 5.4e-6 in m (past the bar) for one draw
    # in a few: many draws, each row its own scales
    ops, kernel = (one_step(3.0, kernel=k, scaled=True, profile=False) for k in (False, True))
    for seed in range(40):
        feeds = step_feeds(np.random.default_rng(seed), 4, 1, 2, 48, 60.0, scaled=True)
        feeds["gates_x"] /= feeds["scale_x"]
        feeds["gates_h"] /= feeds["scale_h"]
        for got, want in zip(kernel.run(None, feeds), ops.run(None, feeds), strict=True):
            np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6, err_msg=f"seed {seed}")


@pytest.mark.parametrize(("top", "centre"), [(127, 128), (63, 64)])
@pytest.mark.parametrize(("rows", "columns"), [(7, 512), (1, 37), (40, 4096), (0, 16)])
def test_the_quantizer_computes_what_the_ops_do_bit_for_bit(rows, columns, top, centre):
    rng = np.random.default_rng(rows + columns)
    x = (rng.standard_normal((rows, columns)) * rng.uniform(0.01, 50, (rows, 1))).astype(np.float32)
    if rows > 2:
        x[1] = 0.0  # a row of zeros: its scale is 1e-30 / top, its values the centre
    session = partial(one_node, QUANTIZE_OP, [("x", F32)], [("q", TensorProto.UINT8), ("scale", F32)],
                      quantize_function(top, centre), top=float(top), centre=centre)  # fmt: skip
    (q_ops, scale_ops), ops = ran(session(kernel=False), {"x": x})
    (q_kernel, scale_kernel), kernel = ran(session(kernel=True), {"x": x})
    assert QUANTIZE_OP not in ops and {"ReduceMax", "QuantizeLinear"} <= ops and kernel == {QUANTIZE_OP}
    assert q_kernel.dtype == np.uint8 and q_kernel.shape == (rows, columns) and scale_kernel.shape == (rows, 1)
    np.testing.assert_array_equal(scale_kernel, scale_ops)
    np.testing.assert_array_equal(q_kernel, q_ops)
    if rows > 2:
        assert (q_kernel[1] == centre).all()
        assert q_kernel.min() == centre - top and q_kernel.max() <= centre + top


def test_a_row_of_halves_rounds_to_even_as_quantize_linear_does():
    x = np.array([[127.0, -127.0, 2.5, -2.5, 3.5, 0.5, -0.5, 1.5]], np.float32)  # the peak 127: a scale of 1
    session = partial(one_node, QUANTIZE_OP, [("x", F32)], [("q", TensorProto.UINT8), ("scale", F32)],
                      quantize_function(127, 128), top=127.0, centre=128)  # fmt: skip
    (q_ops, _), _ = ran(session(kernel=False), {"x": x})
    (q_kernel, scale), _ = ran(session(kernel=True), {"x": x})
    assert scale.tolist() == [[1.0]]
    assert q_kernel.tolist() == q_ops.tolist() == [[255, 1, 130, 126, 132, 128, 128, 130]]


def test_inputs_of_inconsistent_shapes_are_an_error_not_a_crash():
    session = one_step(3.0, kernel=True, profile=False)
    feeds = step_feeds(np.random.default_rng(0), 5, 1, 3, 8, 1.0)
    feeds["last"] = np.array([9], np.int64)  # past the packed positions
    with pytest.raises(Exception, match="ElmoCellStep: inputs of inconsistent shapes"):
        session.run(None, feeds)
    feeds["last"] = np.array([4], np.int64)
    assert session.run(None, feeds)[0].shape == (5, 8)  # and the session goes on


@pytest.mark.parametrize(("name", "shape"), [("scale_x", (4, 1)), ("scale_h", (3, 2)), ("scale_h", (3,))])
def test_scales_of_inconsistent_shapes_are_an_error_not_a_crash(name, shape):
    session = one_step(3.0, kernel=True, scaled=True, profile=False)
    feeds = step_feeds(np.random.default_rng(0), 5, 1, 3, 8, 1.0, scaled=True)
    good = feeds[name]
    feeds[name] = np.ones(shape, np.float32)  # scale_x: one row short of the packed positions'
    with pytest.raises(Exception, match="ElmoScaledCellStep: scales of inconsistent shapes"):
        session.run(None, feeds)
    feeds[name] = good
    assert session.run(None, feeds)[0].shape == (5, 8)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_an_engine_with_the_kernel_and_one_without_agree(tiny_model_dir, sentences, expected, precision):
    with_kernel = Engine(tiny_model_dir, provider="cpu", precision=precision)
    without = Engine(tiny_model_dir, provider="cpu", precision=precision, kernels=False)
    assert with_kernel.kernels and not without.kernels
    got, ops = with_kernel.run(sentences), without.run(sentences)
    assert max(float(np.abs(a - b).max()) for a, b in zip(got, ops, strict=True)) <= 1e-5
    if precision == "fp32":  # both exact: allennlp's numbers within 1e-5
        for layers in (got, ops):
            assert max(float(np.abs(a - b).max()) for a, b in zip(layers, expected, strict=True)) <= 1e-5
