"""The biLM written as one ONNX graph, with a real `Loop` over time so one file serves every length.

Why not `torch.onnx.export`: the dynamo exporter unrolls a Python time loop to the example's length, and
the TorchScript path is deprecated and emits a generic loop. Writing the graph from the module's
parameters lets the loop be exactly what ONNX Runtime runs fastest (measured in bench/engine.py):

* unique tokens only: the char-CNN runs once per distinct token of the batch that the caller has not
  cached (`token_chars`, (U, max_chars)); `cached_vectors` (V, P) are token vectors the caller kept from
  earlier batches (the output `token_vectors`); `token_index` (B, T) places rows of [encoded; cached];
* each layer's input-to-gate products for all time steps are one GEMM per direction before the loop
  (the bias folded in); both directions share one loop;
* no work on padding: rows are sorted longest first inside the graph, the input GEMM runs on the real
  positions only (PyTorch's PackedSequence layout) and step t computes only the rows still running;
* the per-step weights are 2-D constants of the loop body, which ONNX Runtime pre-packs once: a step with
  few rows does not re-pack 40 MB of weights, and every row rounds alike whatever the number of rows (a
  sentence's vectors are the same bits alone or in any batch);
* the backward direction runs on each sentence reversed within its length (`ReverseSequence`), so
  padding stays behind the real tokens in both directions and never reaches them.

Inputs:  token_chars int32 (U, max_chars), U >= 1; cached_vectors float32 (V, P), V >= 0;
         token_index int64 (B, T) into the U + V token vectors; lengths int64 (B,)
         (T counts the boundary tokens <S> and </S>; lengths[b] <= T; positions past lengths[b] are padding)
Outputs: layers float32 (L+1, B, T, 2P); token_vectors float32 (U, P), the char-CNN's output for token_chars
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from model_export.bilm import FORGET_BIAS, BiLM

OPSET = 17
IR_VERSION = 8  # the IR of opset 17; onnx writes its newest by default, which older runtimes refuse
GRAPH_VERSION = 4  # bumped whenever the graph changes (inputs, outputs or what it computes fast)


class _Graph:
    """Collects nodes and initializers; every value gets a fresh name."""

    def __init__(self, prefix: str = ""):
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._prefix = prefix
        self._count = 0

    def _name(self, hint: str) -> str:
        self._count += 1
        return f"{self._prefix}{hint}_{self._count}"

    def const(self, value, hint: str = "c", dtype=np.float32) -> str:
        name = self._name(hint)
        self.initializers.append(numpy_helper.from_array(np.array(value, dtype=dtype, order="C"), name))
        return name

    def op(self, op_type: str, *inputs: str, outputs: int = 1, out: list[str] | None = None, **attrs):
        names = out or [self._name(op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, **attrs))
        return names[0] if len(names) == 1 else names


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().astype(np.float32)


def _token_encoder(g: _Graph, model: BiLM, token_chars: str) -> str:
    """(U, max_chars) char ids -> (U, P) token vectors; the same math as CharCNN.forward."""
    enc = model.token_encoder
    activation = "Relu" if model.options.activation == "relu" else "Tanh"
    table = g.const(_np(enc.char_embed.weight), "char_embed")
    x = g.op("Transpose", g.op("Gather", table, token_chars), perm=[0, 2, 1])  # (U, char_dim, max_chars)
    pooled = []
    for conv in enc.convs:
        y = g.op("Conv", x, g.const(_np(conv.weight), "w_cnn"), g.const(_np(conv.bias), "b_cnn"))
        pooled.append(g.op(activation, g.op("ReduceMax", y, axes=[2], keepdims=0)))
    x = g.op("Concat", *pooled, axis=1)  # (U, n_filters)
    one = g.const(1.0, "one")
    for highway in enc.highways:
        w_transform, w_carry = _np(highway.weight).reshape(2, -1, highway.in_features)
        b_transform, b_carry = _np(highway.bias).reshape(2, -1)
        transform = g.op("Relu", g.op("Gemm", x, g.const(w_transform, "w_tr"), g.const(b_transform, "b_tr"), transB=1))
        carry = g.op("Sigmoid", g.op("Gemm", x, g.const(w_carry, "w_ca"), g.const(b_carry, "b_ca"), transB=1))
        x = g.op("Add", g.op("Mul", carry, transform), g.op("Mul", g.op("Sub", one, carry), x))
    return g.op("Gemm", x, g.const(_np(enc.proj.weight), "w_proj"), g.const(_np(enc.proj.bias), "b_proj"), transB=1)


def _int64_zero() -> onnx.TensorProto:
    return numpy_helper.from_array(np.zeros(1, np.int64))


DIRECTIONS = ("fwd", "bwd")


def _loop_body(opt, cells: list, gates_x: list[str], active: str, offsets: str) -> onnx.GraphProto:
    """Step t of one layer, both directions, over the sentences still running (rows are sorted longest
    first, so they are the first active[t] rows). Per direction: (h, c) (B, P), (B, C) -> next (h, c),
    and h as scan output. The weights live in the body as 2-D constants so ONNX Runtime pre-packs them
    once (see the module docstring)."""
    b = _Graph("step_")
    i64 = np.int64
    axis0, zero, end = b.const([0], "axis", i64), b.const([0], "zero", i64), b.const([2**62], "end", i64)
    n = b.op("Unsqueeze", b.op("Gather", active, "t"), axis0)  # [n_t]
    start = b.op("Unsqueeze", b.op("Gather", offsets, "t"), axis0)
    f32 = TensorProto.FLOAT
    inputs = [
        helper.make_tensor_value_info("t", TensorProto.INT64, []),
        helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
    ]
    outputs = [helper.make_tensor_value_info("cond_next", TensorProto.BOOL, [])]
    scans = []
    for d, cell, gates in zip(DIRECTIONS, cells, gates_x, strict=True):
        h_in, c_in = f"h_{d}", f"c_{d}"
        gates_t = b.op("Slice", gates, start, b.op("Add", start, n), axis0)  # (n_t, 4C): packed rows of step t
        h_run, h_done = b.op("Slice", h_in, zero, n, axis0), b.op("Slice", h_in, n, end, axis0)
        c_run, c_done = b.op("Slice", c_in, zero, n, axis0), b.op("Slice", c_in, n, end, axis0)
        g = b.op("Add", gates_t, b.op("MatMul", h_run, b.const(_np(cell.w_hidden), "w_hidden")))
        i, j, f, o = b.op("Split", g, outputs=4, axis=1)
        c = b.op("Add", b.op("Mul", b.op("Sigmoid", f), c_run), b.op("Mul", b.op("Sigmoid", i), b.op("Tanh", j)))
        if opt.cell_clip:
            c = b.op("Clip", c, b.const(-opt.cell_clip, "lo"), b.const(opt.cell_clip, "hi"))
        h = b.op("MatMul", b.op("Mul", b.op("Sigmoid", o), b.op("Tanh", c)), b.const(_np(cell.w_proj), "w_proj"))
        if opt.proj_clip:
            h = b.op("Clip", h, b.const(-opt.proj_clip, "lo"), b.const(opt.proj_clip, "hi"))
        b.op("Concat", h, h_done, axis=0, out=[f"h_{d}_next"])  # finished rows keep their state: never read
        b.op("Concat", c, c_done, axis=0, out=[f"c_{d}_next"])
        b.op("Identity", f"h_{d}_next", out=[f"h_{d}_scan"])
        inputs += [helper.make_tensor_value_info(name, f32, None) for name in (h_in, c_in)]
        outputs += [helper.make_tensor_value_info(f"{name}_next", f32, None) for name in (h_in, c_in)]
        scans.append(helper.make_tensor_value_info(f"h_{d}_scan", f32, None))
    b.op("Identity", "cond", out=["cond_next"])
    return helper.make_graph(b.nodes, "step", inputs, outputs + scans, initializer=b.initializers)


def build_onnx_model(model: BiLM) -> onnx.ModelProto:
    opt = model.options
    g = _Graph()
    i64 = np.int64
    axis0, axis1 = g.const([0], "axis0", i64), g.const([1], "axis1", i64)
    one, true = g.const(1.0, "one"), g.const(True, "true", np.bool_)

    # Rows longest first (ties keep their order), undone at the end: the rows still running at step t
    # are then the first active[t], and the loop computes only those.
    batch = g.op("Shape", "lengths")  # [B]
    lengths, order = g.op("TopK", "lengths", batch, axis=0, largest=1, sorted=1, outputs=2)
    token_index = g.op("Gather", "token_index", order, axis=0)
    encoded = _token_encoder(g, model, "token_chars")  # (U, P)
    g.op("Identity", encoded, out=["token_vectors"])
    x = g.op("Gather", g.op("Concat", encoded, "cached_vectors", axis=0), token_index)  # (B, T, P)
    x_tm = g.op("Transpose", x, perm=[1, 0, 2])  # (T, B, P) time-major

    # The packed layout of PyTorch's PackedSequence: real (t, b) positions in time-major order.
    steps = g.op("Squeeze", g.op("Shape", x_tm, end=1), axis0)  # T
    time = g.op("Range", g.const(0, "zero", i64), steps, g.const(1, "one_i", i64))
    running = g.op("Less", g.op("Unsqueeze", time, axis1), g.op("Unsqueeze", lengths, axis0))  # (T, B)
    active = g.op("ReduceSum", g.op("Cast", running, to=TensorProto.INT64), axis1, keepdims=0)  # (T,)
    offsets = g.op("CumSum", active, g.const(0, "axis", i64), exclusive=1)  # (T,) first packed row of step t
    t_b = g.op("NonZero", running)  # (2, N)
    t_idx, b_idx = g.op("Gather", t_b, g.const(0, "row", i64)), g.op("Gather", t_b, g.const(1, "row", i64))
    packed_index = g.op("Add", g.op("Mul", t_idx, g.op("Squeeze", batch, axis0)), b_idx)  # (N,) into T*B
    flat_shape = g.const([-1, opt.proj_dim], "flat", i64)
    ones = g.op("Expand", one, g.op("Concat", g.op("Shape", packed_index), g.const([1], "n", i64), axis=0))  # (N, 1)

    # Both directions read the token vectors; the backward one each sentence reversed within its length.
    inputs = [x_tm, g.op("ReverseSequence", x_tm, lengths, batch_axis=1, time_axis=0)]  # (T, B, P) each
    state_shape = {
        name: g.op("Concat", batch, g.const([size], "n", i64), axis=0)
        for name, size in (("h", opt.proj_dim), ("c", opt.cell_dim))
    }

    layers = [g.op("Concat", x_tm, x_tm, axis=2)]  # (T, B, 2P)
    for k, cells in enumerate(zip(model.forward_lstm.layers, model.backward_lstm.layers, strict=True)):
        gates_x, states = [], []
        for cell, x_d in zip(cells, inputs, strict=True):
            bias = _np(cell.bias)[None, :]
            bias[:, 2 * opt.cell_dim : 3 * opt.cell_dim] += FORGET_BIAS  # gates i, j, f, o
            # The bias rides in the GEMM as a row of weights times a column of ones: adding it afterwards
            # would be another pass over the largest tensor of the model.
            w_input = g.const(np.concatenate([_np(cell.w_input), bias]), f"w_input{k}")  # (P+1, 4C)
            packed = g.op("Gather", g.op("Reshape", x_d, flat_shape), packed_index)  # (N, P): real positions only
            gates_x.append(g.op("MatMul", g.op("Concat", packed, ones, axis=1), w_input))  # (N, 4C)
            h0 = g.op("Expand", g.const(_np(cell.h0)[None, :], f"h0_{k}"), state_shape["h"])
            c0 = g.op("Expand", g.const(_np(cell.c0)[None, :], f"c0_{k}"), state_shape["c"])
            states += [h0, c0]
        body = _loop_body(opt, cells, gates_x, active, offsets)
        *_, fwd, bwd = g.op("Loop", steps, true, *states, outputs=6, body=body)  # scans (T, B, P)
        if opt.skip_connections and k > 0:
            fwd, bwd = g.op("Add", fwd, inputs[0]), g.op("Add", bwd, inputs[1])
        inputs = [fwd, bwd]
        backward = g.op("ReverseSequence", bwd, lengths, batch_axis=1, time_axis=0)
        layers.append(g.op("Concat", fwd, backward, axis=2))

    stacked = g.op("Concat", *[g.op("Unsqueeze", layer, axis0) for layer in layers], axis=0)  # (L+1, T, B, 2P)
    sorted_layers = g.op("Transpose", stacked, perm=[0, 2, 1, 3])  # (L+1, B, T, 2P), rows longest first
    rows = g.op("Range", g.const(0, "zero", i64), g.op("Squeeze", batch, axis0), g.const(1, "one_i", i64))
    unsort = g.op("ScatterElements", g.op("ConstantOfShape", batch, value=_int64_zero()), order, rows, axis=0)
    g.op("Gather", sorted_layers, unsort, axis=1, out=["layers"])

    graph = helper.make_graph(
        g.nodes,
        "elmo_bilm",
        [
            helper.make_tensor_value_info("token_chars", TensorProto.INT32, ["tokens", opt.max_chars]),
            helper.make_tensor_value_info("cached_vectors", TensorProto.FLOAT, ["cached", opt.proj_dim]),
            helper.make_tensor_value_info("token_index", TensorProto.INT64, ["batch", "time"]),
            helper.make_tensor_value_info("lengths", TensorProto.INT64, ["batch"]),
        ],
        [
            helper.make_tensor_value_info(
                "layers", TensorProto.FLOAT, [opt.num_output_layers, "batch", "time", opt.output_dim]
            ),
            helper.make_tensor_value_info("token_vectors", TensorProto.FLOAT, ["tokens", opt.proj_dim]),
        ],
        initializer=g.initializers,
    )
    model_proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="elmo-export")
    model_proto.ir_version = IR_VERSION
    return model_proto
