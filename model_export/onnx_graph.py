"""The biLM written as one ONNX graph, with a real `Loop` over time so one file serves every length.

Why not `torch.onnx.export`: the dynamo exporter unrolls a Python time loop to the example's length, and
the TorchScript path is deprecated and emits a generic loop. Writing the graph from the module's
parameters lets the loop be exactly what ONNX Runtime runs fastest (measured in bench/engine.py):

* unique tokens only: the char-CNN runs once per distinct token of the batch (`token_chars`, (U, max_chars))
  and `token_index` (B, T) places the vectors; frequent words and the boundary tokens cost once;
* each layer's input-to-gate products for all time steps and both directions are one batched GEMM
  outside the loop; inside it, one batched GEMM per step does the recurrence of both directions;
* the backward direction runs on each sentence reversed within its length (`ReverseSequence`), so
  padding stays behind the real tokens in both directions and never reaches them.

Inputs:  token_chars int32 (U, max_chars), token_index int64 (B, T), lengths int64 (B,)
         (T counts the boundary tokens <S> and </S>; lengths[b] <= T; positions past lengths[b] are padding)
Output:  layers float32 (L+1, B, T, 2P)
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from model_export.bilm import FORGET_BIAS, BiLM

OPSET = 17
IR_VERSION = 8  # the IR of opset 17; onnx writes its newest by default, which older runtimes refuse


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


def _loop_body(opt, w_hidden: str, w_proj: str, gates_x: str) -> onnx.GraphProto:
    """One time step of both directions: (h, c) (2, B, P), (2, B, C) -> next (h, c), and h as scan output."""
    b = _Graph("step_")
    g = b.op("Add", b.op("Gather", gates_x, "t", axis=1), b.op("MatMul", "h", w_hidden))  # (2, B, 4C)
    i, j, f, o = b.op("Split", g, outputs=4, axis=2)
    c = b.op("Add", b.op("Mul", b.op("Sigmoid", f), "c"), b.op("Mul", b.op("Sigmoid", i), b.op("Tanh", j)))
    if opt.cell_clip:
        c = b.op("Clip", c, b.const(-opt.cell_clip, "lo"), b.const(opt.cell_clip, "hi"))
    b.op("Identity", c, out=["c_next"])
    h = b.op("MatMul", b.op("Mul", b.op("Sigmoid", o), b.op("Tanh", "c_next")), w_proj)  # (2, B, P)
    if opt.proj_clip:
        h = b.op("Clip", h, b.const(-opt.proj_clip, "lo"), b.const(opt.proj_clip, "hi"))
    b.op("Identity", h, out=["h_next"])
    b.op("Identity", h, out=["h_scan"])
    b.op("Identity", "cond", out=["cond_next"])
    f32 = TensorProto.FLOAT
    return helper.make_graph(
        b.nodes,
        "step",
        [
            helper.make_tensor_value_info("t", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("h", f32, None),
            helper.make_tensor_value_info("c", f32, None),
        ],
        [
            helper.make_tensor_value_info("cond_next", TensorProto.BOOL, []),
            helper.make_tensor_value_info("h_next", f32, None),
            helper.make_tensor_value_info("c_next", f32, None),
            helper.make_tensor_value_info("h_scan", f32, None),
        ],
        initializer=b.initializers,
    )


def build_onnx_model(model: BiLM) -> onnx.ModelProto:
    opt = model.options
    p, c4 = opt.proj_dim, 4 * opt.cell_dim
    g = _Graph()
    x = g.op("Gather", _token_encoder(g, model, "token_chars"), "token_index")  # (B, T, P)

    x_tm = g.op("Transpose", x, perm=[1, 0, 2])  # (T, B, P) time-major
    x_rev = g.op("ReverseSequence", x_tm, "lengths", batch_axis=1, time_axis=0)
    zero_axis = g.const([0], "axis0", np.int64)
    inputs = g.op("Concat", g.op("Unsqueeze", x_tm, zero_axis), g.op("Unsqueeze", x_rev, zero_axis), axis=0)
    shape_tb = g.op("Shape", x_tm, end=2)  # [T, B]
    steps = g.op("Squeeze", g.op("Shape", x_tm, end=1), zero_axis)
    true = g.const(True, "true", np.bool_)
    one = g.const(1.0, "one")
    state_shape = {}
    for name, size in (("h", p), ("c", opt.cell_dim)):
        state_shape[name] = g.op(
            "Concat",
            g.const([2], "two", np.int64),
            g.op("Shape", x_tm, start=1, end=2),
            g.const([size], "n", np.int64),
            axis=0,
        )

    layers = [g.op("Concat", x_tm, x_tm, axis=2)]  # (T, B, 2P)
    for k, (fwd, bwd) in enumerate(zip(model.forward_lstm.layers, model.backward_lstm.layers, strict=True)):
        bias = np.stack([_np(fwd.bias), _np(bwd.bias)])[:, None, :]  # (2, 1, 4C)
        bias[..., 2 * opt.cell_dim : 3 * opt.cell_dim] += FORGET_BIAS  # gates i, j, f, o
        # The bias rides in the GEMM as a row of weights times a column of ones: adding it afterwards
        # would be another pass over the largest tensor of the model.
        w_input = np.concatenate([np.stack([_np(fwd.w_input), _np(bwd.w_input)]), bias], axis=1)  # (2, P+1, 4C)
        flat = g.op("Reshape", inputs, g.const([2, -1, p], "flat", np.int64))  # (2, T*B, P)
        ones = g.op("Expand", one, g.op("Concat", g.op("Shape", flat, end=2), g.const([1], "n", np.int64), axis=0))
        flat = g.op("Concat", flat, ones, axis=2)  # (2, T*B, P+1)
        gates_x = g.op("MatMul", flat, g.const(w_input, f"w_input{k}"))  # (2, T*B, 4C)
        gates_x = g.op(
            "Reshape",
            gates_x,
            g.op("Concat", g.const([2], "two", np.int64), shape_tb, g.const([c4], "n", np.int64), axis=0),
        )  # (2, T, B, 4C)
        w_hidden = g.const(np.stack([_np(fwd.w_hidden), _np(bwd.w_hidden)]), f"w_hidden{k}")
        w_proj = g.const(np.stack([_np(fwd.w_proj), _np(bwd.w_proj)]), f"w_proj{k}")
        h0 = g.op("Expand", g.const(np.stack([_np(fwd.h0), _np(bwd.h0)])[:, None, :], f"h0_{k}"), state_shape["h"])
        c0 = g.op("Expand", g.const(np.stack([_np(fwd.c0), _np(bwd.c0)])[:, None, :], f"c0_{k}"), state_shape["c"])
        _, _, scan = g.op(
            "Loop", steps, true, h0, c0, outputs=3, body=_loop_body(opt, w_hidden, w_proj, gates_x)
        )  # scan (T, 2, B, P)
        h = g.op("Transpose", scan, perm=[1, 0, 2, 3])  # (2, T, B, P)
        if opt.skip_connections and k > 0:
            h = g.op("Add", h, inputs)
        inputs = h
        forward, backward = g.op("Split", h, outputs=2, axis=0)
        forward = g.op("Squeeze", forward, zero_axis)
        backward = g.op("ReverseSequence", g.op("Squeeze", backward, zero_axis), "lengths", batch_axis=1, time_axis=0)
        layers.append(g.op("Concat", forward, backward, axis=2))

    stacked = g.op("Concat", *[g.op("Unsqueeze", layer, zero_axis) for layer in layers], axis=0)  # (L+1, T, B, 2P)
    g.op("Transpose", stacked, perm=[0, 2, 1, 3], out=["layers"])

    graph = helper.make_graph(
        g.nodes,
        "elmo_bilm",
        [
            helper.make_tensor_value_info("token_chars", TensorProto.INT32, ["tokens", opt.max_chars]),
            helper.make_tensor_value_info("token_index", TensorProto.INT64, ["batch", "time"]),
            helper.make_tensor_value_info("lengths", TensorProto.INT64, ["batch"]),
        ],
        [
            helper.make_tensor_value_info(
                "layers", TensorProto.FLOAT, [opt.num_output_layers, "batch", "time", opt.output_dim]
            )
        ],
        initializer=g.initializers,
    )
    model_proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="elmo-export")
    model_proto.ir_version = IR_VERSION
    return model_proto
