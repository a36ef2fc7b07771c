"""The biLM written as one ONNX graph, with a real `Loop` over time so one file serves every length.

Why not `torch.onnx.export`: the dynamo exporter unrolls a Python time loop to the example's length, and
the TorchScript path is deprecated and emits a generic loop. Writing the graph from the module's
parameters lets the loop be exactly what ONNX Runtime runs fastest (measured in bench/engine.py):

* unique tokens only: the char-CNN runs once per distinct token of the batch that the caller has not
  cached (`token_chars`, (U, max_chars)); `cached_vectors` (V, P) are token vectors the caller kept from
  earlier batches (the output `token_vectors`); `index_fwd` (B, T) places rows of [encoded; cached];
* each char convolution is one product over every token's char windows, not a Conv (bench.yardstick's profile),
  over the windows that hold a char of some token (past a token's end a window repeats its padding: one kept);
* each layer's input-to-gate products for all time steps are one GEMM per direction before the loop; both
  directions share one loop;
* a step's work between its products (the slice of the input products, the sums with the state's product and
  the bias, the gates, the cell update) is one node, `ElmoCellStep` (`cell_function`): an ONNX function of
  standard ops, which ONNX Runtime inlines, or, where the engine has registered it, this project's kernel of it
  (service/engine/native/), one pass where the ops make a dozen;
* no work on padding: rows are sorted longest first inside the graph, the input GEMM runs on the real
  positions only (PyTorch's PackedSequence layout) and step t computes only the rows still running;
* the per-step weights are 2-D constants of the loop body, which ONNX Runtime pre-packs once: a step with
  few rows does not re-pack 40 MB of weights, and every row rounds alike whatever the number of rows (a
  sentence's vectors are the same bits alone or in any batch);
* the backward direction reads each sentence reversed (`index_bwd`), so padding stays behind the real
  tokens in both directions and never reaches them;
* it runs a window of positions of each sentence, from a given state: the whole sentence from the initial
  state (`Engine.run`), or the next few positions of each sentence in flight, from where its last window
  left it (service/batching/in_flight.py, continuous batching). Window by window or whole, a sentence's
  vectors are the same bits (on CPU; tests/service/batching/test_in_flight.py).

Inputs:  token_chars int32 (U, token_width): char ids (and a word id), U >= 1; cached_vectors float32 (V, P), V >= 0;
         index_fwd, index_bwd int64 (B, T) into the U + V token vectors: each row's window of positions,
         forward, and in the sentence reversed (the backward direction's positions); lengths int64 (B,)
         (positions past lengths[b] are padding); start bool (B,): the row starts its sentence here, from the
         model's initial state, else from the state inputs h_fwd0, c_fwd0, h_bwd0, c_bwd0, h_fwd1, ...
         ((B, P) for h, (B, C) for c; ignored where start)
Outputs: layers_fwd, layers_bwd float32 (L+1, B, T, P): each layer's output at the window's positions, the
         backward ones in the reversed order they were read in (layer 0 is the token vectors);
         h_fwd0_next, ...: each row's state after its last position; token_vectors float32 (U, P), the
         char-CNN's output for token_chars
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from model_export.bilm import FORGET_BIAS, BiLM

OPSET = 17
IR_VERSION = 8  # the IR of opset 17; onnx writes its newest by default, which older runtimes refuse


class _Graph:
    """Collects nodes and initializers; every value gets a fresh name, and every node a name that says where in
    the model it is (`scope`/its output, e.g. `lstm1/step/step_matmul_17`): ONNX Runtime names nodes by it in its
    logs and placement reports, which otherwise read `Squeeze ()`."""

    def __init__(self, prefix: str = "", scope: str = ""):
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.scope = scope
        self._prefix = prefix
        self._count = 0

    @contextlib.contextmanager
    def scoped(self, scope: str):
        """Nodes made inside are named under `scope`."""
        outer, self.scope = self.scope, scope
        try:
            yield
        finally:
            self.scope = outer

    def _name(self, hint: str) -> str:
        self._count += 1
        return f"{self._prefix}{hint}_{self._count}"

    def constant(self, value, dtype=np.float32) -> str:
        """A Constant node's output: a value in an ONNX function's body, which has no initializers."""
        return self.op("Constant", value=numpy_helper.from_array(np.array(value, dtype)))

    def const(self, value, hint: str = "c", dtype=np.float32) -> str:
        name = self._name(hint)
        self.initializers.append(numpy_helper.from_array(np.array(value, dtype=dtype, order="C"), name))
        return name

    def op(self, op_type: str, *inputs: str, outputs: int = 1, out: list[str] | None = None, **attrs):
        names = out or [self._name(op_type.lower()) for _ in range(outputs)]
        name = f"{self.scope}/{names[0]}" if self.scope else names[0]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=name, **attrs))
        return names[0] if len(names) == 1 else names


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().astype(np.float32)


PRECISIONS = ("fp32", "fp16", "int8")
MS_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib ops: MatMulIntegerToFloat, DynamicQuantizeMatMul
# this project's own ops, each defined in standard ops as an ONNX function (`cell_function`, `quantize_function`)
CELL_DOMAIN, CELL_OP, QUANTIZE_OP = "ai.elmo", "ElmoCellStep", "ElmoQuantizeRows"
SCALED_CELL_OP = "ElmoScaledCellStep"  # CELL_OP of int8 products whose rows' scales it applies (`cell_function`)


@dataclass(frozen=True)
class Int8:
    """How the int8 graph computes a product x @ W in integers: W per output column (`weights`: "s8" symmetric,
    "u8" asymmetric with a zero point per column), x per row (`activations`: "row7" in 7 bits centred on 64,
    "row8" in 8 bits centred on 128) or per tensor ("tensor": ONNX Runtime's DynamicQuantizeMatMul, one scale for
    the whole batch). Per row, a sentence's numbers never depend on what it is batched with. 7 bits: a u8 x s8
    product pair then fits int16, which AVX2's VPMADDUBSW saturates at (full 8-bit activations times s8 weights
    overflow it on CPUs without VNNI). `token_encoder`: the highways' and the projection's products in int8 too.
    README, "int8", measured the choices.

    Candidates bench.int8 measures (docs/performance.md, "The time around the products"), off by default: they cut
    the node time around the integer products, which decides a token's time on VNNI and AMX hosts, but cost
    accuracy on some models. `weights` "s7": symmetric in 7 bits, so that 8-bit activations ("row8") keep a pair of
    products within int16 on AVX2. `bounded` (per row only): the LSTM's projection, whose input the cell bounds
    (o * tanh(c) is within 1), quantizes it with one constant scale, 1 / 63 (or 127), instead of each row's: no
    passes to find the rows' peaks, and the product comes out scaled (batch-independent too). `convolutions`
    (with `token_encoder`): the char convolutions in integers, the char table quantized once, per embedding
    dimension, its scales and lows folded into the filters and biases. `fused` (per row only): each step's input
    rows and state side by side, (n, 2P), quantized with one scale a row and multiplied by [w_input; w_hidden] in
    the loop, one product where there were two and the passes over (N, 4C) between them (the input's product
    before the loop, its slice of each step, the sum); a row's smaller half then rounds coarser, which 7 bits
    cannot afford (min cosine 0.9989 on the default model) and 8 bits can. The export's VNNI graph
    (model_export/export.py, INT8_VNNI) takes 8-bit activations with all three."""

    activations: str = "row7"
    weights: str = "s8"
    token_encoder: bool = True
    bounded: bool = False
    convolutions: bool = False
    fused: bool = False

    def __post_init__(self):
        if self.activations not in ("row7", "row8", "tensor") or self.weights not in ("s8", "s7", "u8"):
            raise ValueError(f"no such int8 scheme: {self}")
        if self.fused and self.activations == "tensor":
            raise ValueError(f"fused products are per row: {self}")

    def to_dict(self) -> dict:
        plain = {"activations": self.activations, "weights": self.weights, "token_encoder": self.token_encoder}
        return plain | {name: True for name in ("bounded", "convolutions", "fused") if getattr(self, name)}

    @property
    def levels(self) -> tuple[int, int]:
        """A row's quantized values: (top, centre), x ~ (q - centre) * peak / top."""
        return (63, 64) if self.activations == "row7" else (127, 128)

    @property
    def quantize_attributes(self) -> dict:
        """`QUANTIZE_OP`'s attributes for this scheme's rows."""
        top, centre = self.levels
        return {"top": float(top), "centre": centre}

    @property
    def bounded_cell(self) -> bool:
        """The projection's input, the cell output, quantized with its bound's constant scale (`bounded`)."""
        return self.bounded and self.activations != "tensor"


def quantize_columns(w: np.ndarray, weights: str, top: int = 127) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w (K, N) -> its int8 (or uint8) values, and each column's scale and zero point (N,): w ~ (q - zp) * scale.
    `top`: the largest magnitude of an s8 value (63: 7 bits)."""
    w = w.astype(np.float64)
    if weights == "s8":
        scale = np.abs(w).max(axis=0) / top
        scale[scale == 0] = 1.0
        q = np.clip(np.rint(w / scale), -top, top).astype(np.int8)
        return q, scale.astype(np.float32), np.zeros(w.shape[1], np.int8)
    low, high = np.minimum(w.min(axis=0), 0), np.maximum(w.max(axis=0), 0)
    scale = (high - low) / 255
    scale[scale == 0] = 1.0
    zero = np.clip(np.rint(-low / scale), 0, 255)
    q = np.clip(np.rint(w / scale) + zero, 0, 255).astype(np.uint8)
    return q, scale.astype(np.float32), zero.astype(np.uint8)


class _Precision:
    """How the graph computes its products. fp32: as written, no casts at all. fp16 (the window graph's reduced
    precision): the products (MatMul, Gemm, Conv) take fp16 operands and weights; everything that decides accuracy
    stays fp32 (the gate nonlinearities, the cell state, clipping, the masks and the state kept between windows).
    int8 (the CPU's Loop graph): the matrix products in integers as `Int8` says, everything else fp32."""

    def __init__(self, g: _Graph, precision: str, int8: Int8 | None = None):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
        self.g, self.precision, self.half = g, precision, precision == "fp16"
        self.int8 = (int8 or Int8()) if precision == "int8" else None

    def weight(self, value: np.ndarray, hint: str) -> str:
        """A weight read as it is (fp16 in the fp16 graph, else fp32)."""
        return self.g.const(value, hint, np.float16 if self.half else np.float32)

    def matrix(self, value: np.ndarray, hint: str) -> str | tuple[str, str, str]:
        """The right-hand matrix (K, N) of products: a `weight`, or in int8 its values, scales and zero points."""
        if not self.int8:
            return self.weight(value, hint)
        weights = "s8" if self.int8.weights == "s7" else self.int8.weights
        q, scale, zero = quantize_columns(value, weights, top=63 if self.int8.weights == "s7" else 127)
        return (
            self.g.const(q, hint, q.dtype),
            self.g.const(scale, f"{hint}_scale"),
            self.g.const(zero, f"{hint}_zero", zero.dtype),
        )

    def down(self, x: str) -> str:
        return self.g.op("Cast", x, to=TensorProto.FLOAT16) if self.half else x

    def up(self, x: str) -> str:
        return self.g.op("Cast", x, to=TensorProto.FLOAT) if self.half else x

    def matmul(self, x: str, w, bias: str | None = None):
        """x (fp32) @ w (a `matrix`) (+ bias, fp32, in int8 only) -> fp32. In int8 per row, x is quantized by one
        `QUANTIZE_OP` node (`quantize_function`)."""
        if not self.int8:
            return self.up(self.g.op("MatMul", self.down(x), w))
        g, (values, scale, zero) = self.g, w
        if self.int8.activations == "tensor":
            return g.op("DynamicQuantizeMatMul", x, values, scale, zero, *([bias] if bias else []), domain=MS_DOMAIN)
        quantized, row_scale, centre = self._quantized_rows(x)
        # the rows' scales as A's scale: ONNX Runtime multiplies its output by them after the columns' scales (the
        # same float products as a Mul after it), so no Mul node, but in a pass of its own on one thread
        # (`matmul_rows_apart` leaves them to the LSTM's step instead); the bias after them
        product = g.op("MatMulIntegerToFloat", quantized, values, row_scale, scale, centre, zero, domain=MS_DOMAIN)
        return g.op("Add", product, bias) if bias else product

    def _quantized_rows(self, x: str) -> tuple[str, str, str]:
        """x quantized a row at a time (`QUANTIZE_OP`): each row's own scale, so that a row's numbers do not depend
        on the other rows. Returns the quantized rows, their scales (M, 1) and the zero point they are centred on."""
        quantized, row_scale = self.g.op(QUANTIZE_OP, x, outputs=2, domain=CELL_DOMAIN, **self.int8.quantize_attributes)
        return quantized, row_scale, self.g.const(self.int8.levels[1], "centre", np.uint8)

    def matmul_rows_apart(self, x: str, w) -> tuple[str, str]:
        """x @ w in int8 per row (`matmul`'s product) without the rows' scales, and those scales (M, 1): ONNX
        Runtime applies a scale a row (MatMulIntegerToFloat's A scale, where it is not one number) in a pass of its
        own over the output after the product, on one thread, where a scale a column costs nothing (it is applied
        inside the product). The LSTM's products feed the cell's step, which reads every gate anyway and
        multiplies in the rows' scales (SCALED_CELL_OP): the same float products as `matmul`'s, one pass fewer."""
        g, (values, scale, zero) = self.g, w
        quantized, row_scale, centre = self._quantized_rows(x)
        one = g.const(1.0, "one")
        return g.op("MatMulIntegerToFloat", quantized, values, one, scale, centre, zero, domain=MS_DOMAIN), row_scale

    @property
    def rows_apart(self) -> bool:
        """The LSTM's int8 products leave their rows' scales to the step (`matmul_rows_apart`)."""
        return bool(self.int8) and self.int8.activations != "tensor" and not self.int8.fused

    def matmul_bounded(self, x: str, w, bound: float, bias: str | None = None) -> str:
        """x @ w (+ bias) in int8 for x within [-bound, bound] (`Int8.bounded`): one constant scale, the product
        scaled (and biased) in its own kernel. A value past the bound would saturate."""
        g, (values, scale, zero) = self.g, w
        top, centre = self.int8.levels
        a_scale, a_zero = g.const(bound / top, "bound_scale"), g.const(centre, "centre", np.uint8)
        quantized = g.op("QuantizeLinear", x, a_scale, a_zero)
        return g.op("MatMulIntegerToFloat", quantized, values, a_scale, scale, a_zero, zero, *([bias] if bias else []),
                    domain=MS_DOMAIN)  # fmt: skip

    def linear(self, x: str, w: np.ndarray, b: np.ndarray, hint: str, quantize: bool = True) -> str:
        """x @ w.T + b for w (out, in), as torch.nn.Linear: one Gemm, or in int8 (where `quantize`) a `matmul`."""
        if self.int8 and quantize:
            return self.matmul(x, self.matrix(np.ascontiguousarray(w.T), f"w_{hint}"), self.g.const(b, f"b_{hint}"))
        return self.g.op("Gemm", x, self.weight(w, f"w_{hint}"), self.weight(b, f"b_{hint}"), transB=1)


def token_width(opt) -> int:
    """Ints per token in `token_chars`: max_chars char ids, then the word id where the model has a word table."""
    return opt.max_chars + (1 if opt.word_dim else 0)


def _token_encoder(p: _Precision, model: BiLM, token_chars: str, windows_as_products: bool = False) -> str:
    """(U, token_width) ids -> (U, P) token vectors, fp32; the same math as CharCNN.forward (its products in
    fp16 or int8 where the precision asks for them; the convolutions never in int8). `windows_as_products`: each
    convolution as one product over every token's windows (`_convolution_as_product`), the Loop graphs' way."""
    g, enc, opt = p.g, model.token_encoder, model.options
    activation = "Relu" if opt.activation == "relu" else "Tanh"
    quantize = p.int8 is not None and p.int8.token_encoder
    words = None
    with g.scoped("char_cnn"):
        if enc.word_embed is not None:  # the last column holds word ids (ELMoForManyLangs)
            i64 = np.int64
            columns = g.const([opt.max_chars], "split", i64), g.const([opt.max_chars + 1], "end", i64)
            axis1 = g.const([1], "axis1", i64)
            words = g.op("Squeeze", g.op("Slice", token_chars, columns[0], columns[1], axis1), axis1)  # (U,)
            token_chars = g.op("Slice", token_chars, g.const([0], "zero", i64), columns[0], axis1)  # (U, max_chars)
        pooled = []
        if windows_as_products:
            if quantize and p.int8.convolutions and p.int8.activations != "tensor":
                table = _quantized_table(p, _np(enc.char_embed.weight))
            else:
                table = p.weight(_np(enc.char_embed.weight), "char_embed")
            used = _chars_used(g, token_chars, opt.max_chars)
            for conv in enc.convs:
                y = _convolution_as_product(p, table, token_chars, conv, opt.max_chars, used)
                pooled.append(g.op(activation, y))
        else:
            table = p.weight(_np(enc.char_embed.weight), "char_embed")
            x = g.op("Transpose", g.op("Gather", table, token_chars), perm=[0, 2, 1])  # (U, char_dim, max_chars)
            for conv in enc.convs:
                y = g.op("Conv", x, p.weight(_np(conv.weight), "w_cnn"), p.weight(_np(conv.bias), "b_cnn"))
                pooled.append(g.op(activation, g.op("ReduceMax", y, axes=[2], keepdims=0)))
        x = g.op("Concat", *pooled, axis=1)  # (U, n_filters)
    for k, highway in enumerate(enc.highways):
        with g.scoped(f"highway{k}"):
            w_transform, w_carry = _np(highway.weight).reshape(2, -1, highway.in_features)
            b_transform, b_carry = _np(highway.bias).reshape(2, -1)
            transform = g.op("Relu", p.linear(x, w_transform, b_transform, "tr", quantize))
            carry = g.op("Sigmoid", p.linear(x, w_carry, b_carry, "ca", quantize))
            one = p.weight(np.array(1.0), "one")
            x = g.op("Add", g.op("Mul", carry, transform), g.op("Mul", g.op("Sub", one, carry), x))
    with g.scoped("projection"):
        if words is not None:  # (U, word_dim + n_filters)
            x = g.op("Concat", g.op("Gather", p.weight(_np(enc.word_embed.weight), "word_embed"), words), x, axis=1)
        return p.up(p.linear(x, _np(enc.proj.weight), _np(enc.proj.bias), "proj", quantize))


def _chars_used(g: _Graph, token_chars: str, max_chars: int) -> str:
    """[S]: 1 + the last column in which some token's id differs from its own last column, + 1. Past it every
    token's row repeats its last id (the padding char, in a token shorter than the row), so its windows of w chars
    starting there are all one window (`_convolution_as_product`). At least 1."""
    i64 = np.int64
    column = g.const([max_chars - 1], "last", i64), g.const([max_chars], "end", i64), g.const([1], "axis1", i64)
    last = g.op("Slice", token_chars, *column)  # (U, 1)
    # each column's position + 1 where the id differs from the row's last, else 0; the largest of them, + 1
    positions = g.const(np.arange(1, max_chars + 1), "positions", i64)
    differs = g.op("Where", g.op("Equal", token_chars, last), g.const(0, "zero", i64), positions)  # (U, max_chars)
    used = g.op("Add", g.op("ReduceMax", differs, keepdims=0), g.const(1, "one_i", i64))
    return g.op("Unsqueeze", used, g.const([0], "axis0", i64))


def _convolution_as_product(p: _Precision, table: str, token_chars: str, conv, max_chars: int, used: str) -> str:
    """One char convolution of width w and its max-pool: (U, max_chars) char ids -> (U, n) before the activation.
    Each token's windows of w chars (L = max_chars - w + 1 of them) are gathered, their embeddings side by side
    (U, L, w * char_dim), and multiplied by the filters as one (w * char_dim, n) matrix: one large product where
    ONNX Runtime's Conv took 12-26% of a full-size bulk batch's node time for 9% of its FLOPs (docs/performance.md,
    "The machine's own limit"). The
    bias comes after the max (max(y + b) = max(y) + b, also in floating point, rounding being monotonic): one pass
    over (U, n) instead of (U, L, n).

    Only the first `used` windows (`_chars_used`) are computed: a window starting past a token's last distinct
    column holds its last id w times, as the window starting there does, which is kept; the same ids give the same
    bits (a row of a product rounds alike whatever the other rows), so the max is the same bits as over all L.
    Tokens of 2-12 letters in a row of 50 chars: 13-15 of 44-50 windows."""
    g = p.g
    n, char_dim, width = conv.weight.shape  # Conv1d's (out, in, kernel)
    starts = np.arange(max_chars - width + 1)[:, None] + np.arange(width)[None, :]  # (L, w)
    starts = g.op("Slice", g.const(starts, "windows", np.int64), g.const([0], "zero", np.int64), used)  # (S, w)
    windows = g.op("Gather", token_chars, starts, axis=1)  # (U, S, w) char ids
    filters = _np(conv.weight).transpose(2, 1, 0).reshape(width * char_dim, n)  # [k * char_dim + d, f]
    if isinstance(table, tuple):  # int8: the table's values, and its scale per embedding dimension (char_dim,)
        q_table, dim_scale = table
        chars = g.op("Gather", q_table, windows)
        flat = g.op("Reshape", chars, g.const([0, 0, width * char_dim], "windows_flat", np.int64))
        # the table's scales folded into the filters, x[k] * s[k] * w[k, f] = x[k] * (s[k] * w[k, f]), in 7 bits:
        # with the table's 8, a pair of products still fits the int16 of AVX2's VPMADDUBSW (`Int8`); in 8 where
        # the activations are in 8 bits too (row8: for VNNI and AMX only)
        top = 127 if p.int8.activations == "row8" else 63
        q, scale, zero = quantize_columns(filters * np.tile(dim_scale, width)[:, None], "s8", top=top)
        one, centre = g.const(1.0, "one"), g.const(128, "centre", np.uint8)
        y = g.op("MatMulIntegerToFloat", flat, g.const(q, "w_cnn", np.int8), one, g.const(scale, "w_cnn_scale"),
                 centre, g.const(zero, "w_cnn_zero", np.int8), domain=MS_DOMAIN)  # fmt: skip
    else:
        chars = g.op("Gather", table, windows)  # (U, L, w, char_dim)
        flat = g.op("Reshape", chars, g.const([0, 0, width * char_dim], "windows_flat", np.int64))
        y = p.up(g.op("MatMul", p.down(flat), p.weight(filters, "w_cnn")))  # (U, L, n)
    return g.op("Add", g.op("ReduceMax", y, axes=[1], keepdims=0), p.weight(_np(conv.bias), "b_cnn"))


def _quantized_table(p: _Precision, table: np.ndarray) -> tuple[str, np.ndarray]:
    """The char table (chars, char_dim) in 8 bits once for all (`Int8.convolutions`): each embedding dimension's
    values over its own constant scale (a property of the weights, not of the batch), centred on 128. Returns the
    quantized table's name and its scale per dimension, which the convolutions fold into their filters. (From each
    dimension's low to its high in 7 bits, its low folded into the bias, measured 1.1-1.6x the error.)"""
    scale = np.abs(table).max(axis=0).astype(np.float64) / 127
    scale[scale == 0] = 1.0
    q = (np.clip(np.rint(table / scale), -127, 127) + 128).astype(np.uint8)
    return p.g.const(q, "char_embed_q", np.uint8), scale


def _int64_zero() -> onnx.TensorProto:
    return numpy_helper.from_array(np.zeros(1, np.int64))


DIRECTIONS = ("fwd", "bwd")


def _loop_body(opt, cells: list, gates_x: list, biases: list, packed: _Packed, precision: str, int8, scope: str):
    """Step t of one layer, both directions, over the sentences still running (rows are sorted longest
    first, so they are the first active[t] rows). Per direction: (h, c) (B, P), (B, C) -> next (h, c),
    and h as scan output. `gates_x`: each direction's input products (N, 4C), scaled, not biased (`Int8.fused`:
    its input rows (N, P); int8 by rows otherwise: the products and their rows' scales (N, 1),
    `_Precision.matmul_rows_apart`); `biases`: each direction's gate bias (4C,). Between the state's product and the
    projection, a step is one `CELL_OP` node (`cell_function`). The weights live in the body as 2-D constants so
    ONNX Runtime pre-packs them once (see the module docstring). What a step reads of the packed layout is one
    Gather each, shared by both directions: each node of the body runs at every step (a node costs its own kernel's
    start and the Loop's scheduling of it, as much as a small pass: bench.int8 --profile)."""
    b = _Graph("step_", scope)
    p = _Precision(b, precision, int8)
    i64 = np.int64
    # [n_t, B - n_t], [first], [past the last packed row]
    sizes, first, last = b.op("Split", b.op("Gather", packed.step_table, "t"), b.const([2, 1, 1], "parts", i64),
                              outputs=3)  # fmt: skip
    f32 = TensorProto.FLOAT
    inputs = [
        helper.make_tensor_value_info("t", TensorProto.INT64, []),
        helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
    ]
    outputs = [helper.make_tensor_value_info("cond_next", TensorProto.BOOL, [])]
    scans = []
    for d, cell, gates, bias in zip(DIRECTIONS, cells, gates_x, biases, strict=True):
        h_in, c_in = f"h_{d}", f"c_{d}"
        h_run, h_done = b.op("Split", h_in, sizes, axis=0, outputs=2)
        w_proj = p.matrix(_np(cell.w_proj), "w_proj")
        if p.int8 and p.int8.fused:  # the step's input rows and its state in one product
            c_run, c_done = b.op("Split", c_in, sizes, axis=0, outputs=2)
            joint = b.op("Concat", b.op("Slice", gates, first, last, b.const([0], "axis", i64)), h_run, axis=1)
            w_joint = p.matrix(np.concatenate([_np(cell.w_input), _np(cell.w_hidden)]), "w_joint")
            gates_t = p.matmul(joint, w_joint, b.const(bias, "b_input"))  # (n_t, 2P)
            h, c = _cell_step(p, opt, w_proj, gates_t, c_run)
        else:
            w_hidden, m = p.matrix(_np(cell.w_hidden), "w_hidden"), f"m_{d}"
            if p.rows_apart:  # the products' rows' scales applied in the step
                (gates, scale_x), (gates_h, scale_h) = gates, p.matmul_rows_apart(h_run, w_hidden)
                op, scales = SCALED_CELL_OP, [scale_x, scale_h]
            else:
                op, scales, gates_h = CELL_OP, [], p.matmul(h_run, w_hidden)  # (n_t, 4C)
            # the whole state in and out: the op copies the finished rows' (never read again, kept for the
            # state outputs) where a Split and a Concat would pass over every row's
            step = [gates, first, last, gates_h, b.const(bias, "b_gates"), c_in, sizes, *scales]
            b.op(op, *step, domain=CELL_DOMAIN, cell_clip=float(opt.cell_clip or 0.0), out=[f"c_{d}_next", m])
            h = _projected(p, opt, w_proj, m)
        b.op("Concat", h, h_done, axis=0, out=[f"h_{d}_next"])  # finished rows keep their state: never read
        if p.int8 and p.int8.fused:
            b.op("Concat", c, c_done, axis=0, out=[f"c_{d}_next"])
        b.op("Identity", f"h_{d}_next", out=[f"h_{d}_scan"])
        inputs += [helper.make_tensor_value_info(name, f32, None) for name in (h_in, c_in)]
        outputs += [helper.make_tensor_value_info(f"{name}_next", f32, None) for name in (h_in, c_in)]
        scans.append(helper.make_tensor_value_info(f"h_{d}_scan", f32, None))
    b.op("Identity", "cond", out=["cond_next"])
    return helper.make_graph(b.nodes, "step", inputs, outputs + scans, initializer=b.initializers)


def cell_function(cell_clip: float, scaled: bool = False) -> onnx.FunctionProto:
    """ElmoCellStep, one step of the projected LSTM cell between its products, as an ONNX function of standard ops:
    (gates_x (N, 4C), first, last (1,), gates_h (n, 4C), bias (4C,), c (B, C), sizes [n, B - n]) -> (c' (B, C),
    m (n, C)): for the first n rows (those running) c' = clip(sigmoid(f) * c + sigmoid(i) * tanh(j)) and m =
    sigmoid(o) * tanh(c'), the gates (gates_x[first:last] + bias) + gates_h in the order i, j, f, o; the other rows
    of c' are c's. ONNX Runtime inlines a model's function where no kernel of that name is registered, so the
    graph runs as the ops below anywhere; an engine that loads this project's kernel of it
    (service/engine/native/ops.cc) makes the step one pass over the gates instead of a dozen. `scaled`:
    SCALED_CELL_OP, two more inputs, the rows' scales of int8 products that come without them
    (`_Precision.matmul_rows_apart`), scale_x (N, 1) and scale_h (n, 1): the gates (gates_x[first:last] *
    scale_x[first:last] + bias) + gates_h * scale_h."""
    g = _Graph("cell_")
    gates_x, first, last, gates_h, bias, state, sizes = "gates_x", "first", "last", "gates_h", "bias", "c", "sizes"
    c, c_done = g.op("Split", state, sizes, axis=0, outputs=2)
    axis0 = g.constant([0], np.int64)
    x_t, h_t = g.op("Slice", gates_x, first, last, axis0), gates_h
    if scaled:
        x_t = g.op("Mul", x_t, g.op("Slice", "scale_x", first, last, axis0))
        h_t = g.op("Mul", h_t, "scale_h")
    gates = g.op("Add", g.op("Add", x_t, bias), h_t)
    i, j, f, o = g.op("Split", gates, outputs=4, axis=1)
    update = g.op("Mul", g.op("Sigmoid", f), c), g.op("Mul", g.op("Sigmoid", i), g.op("Tanh", j))
    c_next = g.op("Add", *update)
    if cell_clip:
        c_next = g.op("Clip", c_next, g.constant(-cell_clip), g.constant(cell_clip))
    g.op("Concat", c_next, c_done, axis=0, out=["c_next"])
    g.op("Mul", g.op("Sigmoid", o), g.op("Tanh", c_next), out=["m"])
    return helper.make_function(
        CELL_DOMAIN,
        SCALED_CELL_OP if scaled else CELL_OP,
        [gates_x, first, last, gates_h, bias, state, sizes, *(["scale_x", "scale_h"] if scaled else [])],
        ["c_next", "m"],
        g.nodes,
        [helper.make_opsetid("", OPSET)],
        attributes=["cell_clip"],
    )


def quantize_function(top: int, centre: int) -> onnx.FunctionProto:
    """ElmoQuantizeRows, int8's quantization of a product's input with a scale a row, as an ONNX function of standard
    ops: x (M, K) -> (q (M, K) uint8, scale (M, 1)), scale = max(max |x|, 1e-30) / top of each row and q x / scale
    rounded half to even, plus `centre`, saturated (QuantizeLinear per axis 0: one pass over x). Six nodes and
    three passes over the rows where this project's kernel (service/engine/native/ops.cc) makes one; its attributes
    (top, centre) are for the kernel, the body has them as constants."""
    g = _Graph("quantize_")
    peak = g.op("Max", g.op("ReduceMax", g.op("Abs", "x"), axes=[1], keepdims=1), g.constant(1e-30))
    g.op("Div", peak, g.constant(float(top)), out=["scale"])  # (M, 1)
    scales = g.op("Squeeze", "scale", g.constant([1], np.int64))  # (M,)
    zero_point = g.op("Expand", g.constant(centre, np.uint8), g.op("Shape", scales))
    g.op("QuantizeLinear", "x", scales, zero_point, axis=0, out=["q"])
    return helper.make_function(CELL_DOMAIN, QUANTIZE_OP, ["x"], ["q", "scale"], g.nodes,
                                [helper.make_opsetid("", OPSET)], attributes=["top", "centre"])  # fmt: skip


def build_onnx_model(model: BiLM, precision: str = "fp32", int8: Int8 | None = None) -> onnx.ModelProto:
    """The Loop graph (the module docstring): fp32, exact; or int8, its products in integers as `int8` says
    (default: `Int8()`), for the CPU."""
    if precision not in ("fp32", "int8"):
        raise ValueError(f"the Loop graph is written in fp32 or int8, not {precision!r}")
    opt, g = model.options, _Graph()
    p = _Precision(g, precision, int8)
    f32, axis0 = TensorProto.FLOAT, g.const([0], "axis0", np.int64)
    order, lengths, unsort = _longest_first(g)
    encoded = _token_encoder(p, model, "token_chars", windows_as_products=True)  # (U, P)
    g.op("Identity", encoded, out=["token_vectors"])
    table = g.op("Concat", encoded, "cached_vectors", axis=0)
    # Each direction reads its own positions (the backward one the sentence reversed), time-major (T, B, P).
    inputs = [
        g.op("Transpose", g.op("Gather", table, g.op("Gather", f"index_{d}", order, axis=0)), perm=[1, 0, 2])
        for d in DIRECTIONS
    ]
    packed = _packed_layout(g, inputs[0], lengths, opt.proj_dim)
    start = g.op("Unsqueeze", g.op("Gather", "start", order, axis=0), g.const([1], "axis1", np.int64))  # (B, 1)
    graph_inputs = [
        helper.make_tensor_value_info("token_chars", TensorProto.INT32, ["tokens", token_width(opt)]),
        helper.make_tensor_value_info("cached_vectors", f32, ["cached", opt.proj_dim]),
        helper.make_tensor_value_info("index_fwd", TensorProto.INT64, ["batch", "time"]),
        helper.make_tensor_value_info("index_bwd", TensorProto.INT64, ["batch", "time"]),
        helper.make_tensor_value_info("lengths", TensorProto.INT64, ["batch"]),
        helper.make_tensor_value_info("start", TensorProto.BOOL, ["batch"]),
    ]
    graph_outputs = []
    outputs = {d: [x] for d, x in zip(DIRECTIONS, inputs, strict=True)}  # layer 0: the token vectors
    for k, cells in enumerate(zip(model.forward_lstm.layers, model.backward_lstm.layers, strict=True)):
        with g.scoped(f"lstm{k}"):
            fwd, bwd = _loop_layer(p, opt, k, cells, inputs, packed, start, order, unsort, graph_inputs, graph_outputs)
            if opt.skip_connections and k > 0:
                fwd, bwd = g.op("Add", fwd, inputs[0]), g.op("Add", bwd, inputs[1])
        inputs = [fwd, bwd]
        outputs["fwd"].append(fwd)
        outputs["bwd"].append(bwd)

    shape = [opt.num_output_layers, "batch", "time", opt.proj_dim]
    for d in DIRECTIONS:
        stacked = g.op("Concat", *[g.op("Unsqueeze", x, axis0) for x in outputs[d]], axis=0)  # (L+1, T, B, P)
        g.op("Gather", g.op("Transpose", stacked, perm=[0, 2, 1, 3]), unsort, axis=1, out=[f"layers_{d}"])
        graph_outputs.append(helper.make_tensor_value_info(f"layers_{d}", f32, shape))
    graph_outputs.append(helper.make_tensor_value_info("token_vectors", f32, ["tokens", opt.proj_dim]))
    # the bodies' CELL_OP (or SCALED_CELL_OP)
    functions = [] if p.int8 and p.int8.fused else [cell_function(float(opt.cell_clip or 0.0), p.rows_apart)]
    if p.int8 and p.int8.activations != "tensor":
        functions.append(quantize_function(*p.int8.levels))
    return _model(g, "elmo_bilm", graph_inputs, graph_outputs, ms_domain=p.int8 is not None, functions=functions)


def _longest_first(g: _Graph) -> tuple[str, str, str]:
    """Rows longest first (ties keep their order), undone at the end: the rows still running at step t are then
    the first active[t], and the loop computes only those. Returns the order, the sorted lengths, and the
    permutation that undoes the order."""
    i64, axis0 = np.int64, g.const([0], "axis0", np.int64)
    batch = g.op("Shape", "lengths")  # [B]
    lengths, order = g.op("TopK", "lengths", batch, axis=0, largest=1, sorted=1, outputs=2)
    rows = g.op("Range", g.const(0, "zero", i64), g.op("Squeeze", batch, axis0), g.const(1, "one_i", i64))
    unsort = g.op("ScatterElements", g.op("ConstantOfShape", batch, value=_int64_zero()), order, rows, axis=0)
    return order, lengths, unsort


@dataclass(frozen=True)
class _Packed:
    """PyTorch's PackedSequence layout of a batch: its real (t, b) positions in time-major order, and what each
    step of the Loop reads of it (`step_table`: one Gather a step)."""

    steps: str  # T
    # (T, 4) at step t: the rows still running (the first of the sorted rows) and the rows done, how the state
    # splits; the first and past the last packed row of the step
    step_table: str
    index: str  # (N,): each real position's index into the (T*B) positions
    flat_shape: str  # [-1, P]


def _packed_layout(g: _Graph, x: str, lengths: str, proj: int) -> _Packed:
    i64 = np.int64
    axis0, axis1 = g.const([0], "axis0", i64), g.const([1], "axis1", i64)
    steps = g.op("Squeeze", g.op("Shape", x, end=1), axis0)  # T
    time = g.op("Range", g.const(0, "zero", i64), steps, g.const(1, "one_i", i64))
    running = g.op("Less", g.op("Unsqueeze", time, axis1), g.op("Unsqueeze", lengths, axis0))  # (T, B)
    active = g.op("ReduceSum", g.op("Cast", running, to=TensorProto.INT64), axis1, keepdims=1)  # (T, 1)
    offsets = g.op("CumSum", active, g.const(0, "axis", i64), exclusive=1)  # (T, 1) first packed row of step t
    t_b = g.op("NonZero", running)  # (2, N)
    t_idx, b_idx = g.op("Gather", t_b, g.const(0, "row", i64)), g.op("Gather", t_b, g.const(1, "row", i64))
    batch = g.op("Shape", "lengths")  # [B]
    done = g.op("Sub", batch, active)
    table = g.op("Concat", active, done, offsets, g.op("Add", offsets, active), axis=1)  # (T, 4)
    index = g.op("Add", g.op("Mul", t_idx, g.op("Squeeze", batch, axis0)), b_idx)  # (N,) into T*B
    return _Packed(steps, table, index, g.const([-1, proj], "flat", i64))


def _loop_layer(p: _Precision, opt, k: int, cells, inputs, packed: _Packed, start, order, unsort, graph_inputs,
                graph_outputs) -> tuple[str, str]:  # fmt: skip
    """One biLSTM layer of the Loop graph: each direction's input products for every real position in one product,
    its state (the initial one where `start`, else the row's given one), the Loop over time; returns each
    direction's outputs (T, B, P), and names the state inputs and outputs it adds."""
    g, f32 = p.g, TensorProto.FLOAT
    gates_x, biases, states = [], [], []
    for d, cell, x_d in zip(DIRECTIONS, cells, inputs, strict=True):
        bias = _np(cell.bias)
        bias[2 * opt.cell_dim : 3 * opt.cell_dim] += FORGET_BIAS  # gates i, j, f, o
        biases.append(bias)
        rows = g.op("Gather", g.op("Reshape", x_d, packed.flat_shape), packed.index)  # (N, P): real positions
        if p.int8 and p.int8.fused:  # the products in the loop (`_loop_body`)
            gates_x.append(rows)
        elif p.rows_apart:  # (N, 4C) and its rows' scales (N, 1), which the step applies
            gates_x.append(p.matmul_rows_apart(rows, p.matrix(_np(cell.w_input), f"w_input{k}")))
        else:  # the bias is added in the step, with the state's product (`cell_function`): no pass of its own
            gates_x.append(p.matmul(rows, p.matrix(_np(cell.w_input), f"w_input{k}")))  # (N, 4C)
        for kind, initial, size in (("h", cell.h0, opt.proj_dim), ("c", cell.c0, opt.cell_dim)):
            name = f"{kind}_{d}{k}"
            graph_inputs.append(helper.make_tensor_value_info(name, f32, ["batch", size]))
            graph_outputs.append(helper.make_tensor_value_info(f"{name}_next", f32, ["batch", size]))
            given = g.op("Gather", name, order, axis=0)
            states.append(g.op("Where", start, g.const(_np(initial)[None, :], f"{kind}0_{k}"), given))
    body = _loop_body(opt, cells, gates_x, biases, packed, p.precision, p.int8, f"lstm{k}/step")
    *final, fwd, bwd = g.op("Loop", packed.steps, g.const(True, "true", np.bool_), *states, outputs=6, body=body)
    for name, state in zip(("h_fwd", "c_fwd", "h_bwd", "c_bwd"), final, strict=True):
        g.op("Gather", state, unsort, axis=0, out=[f"{name}{k}_next"])  # each row's state after its last
    return fwd, bwd


# ---- the window graph: no Loop, static shapes, rows packed with sentences ----------------------------------------


def _cell_step(p: _Precision, opt, w_proj, gates: str, c: str) -> tuple[str, str]:
    """One step of a projected LSTM cell: its gates (B, 4C) (the input's and the state's products, bias included),
    cell state c -> (h', c'), with the projection `w_proj` written once for all steps. Gates in the order i, j,
    f, o; the forget bias is in the gates."""
    g = p.g
    i, j, f, o = g.op("Split", gates, outputs=4, axis=1)
    c = g.op("Add", g.op("Mul", g.op("Sigmoid", f), c), g.op("Mul", g.op("Sigmoid", i), g.op("Tanh", j)))
    if opt.cell_clip:
        c = g.op("Clip", c, g.const(-opt.cell_clip, "lo"), g.const(opt.cell_clip, "hi"))
    m = g.op("Mul", g.op("Sigmoid", o), g.op("Tanh", c))  # within (-1, 1)
    return _projected(p, opt, w_proj, m), c


def _projected(p: _Precision, opt, w_proj, m: str) -> str:
    """The cell output m (B, C) projected, and clipped where the model clips it."""
    g = p.g
    h = p.matmul_bounded(m, w_proj, 1.0) if p.int8 and p.int8.bounded_cell else p.matmul(m, w_proj)
    if opt.proj_clip:
        h = g.op("Clip", h, g.const(-opt.proj_clip, "lo"), g.const(opt.proj_clip, "hi"))
    return h


def build_window_model(model: BiLM, window: int, precision: str = "fp32") -> onnx.ModelProto:
    """The biLM as a graph a GPU likes: `window` time steps unrolled, no Loop and no value the host must read,
    every shape fixed by the inputs' shapes (each bucket the engine feeds can be captured as a CUDA graph), both
    directions in one product per step, and rows packed: a row runs several sentences one after the other,
    starting each where `resets` says, so no row idles while sentences wait (service/engine/packing.py).

    Inputs:  token_chars int32 (U, token_width), cached_vectors float32 (V, P): as the Loop graph's;
             index int64 (2, B, W) into the U + V token vectors: each row's positions, forward (0) and in each
             sentence reversed (1: the backward direction's positions); resets bool (B, W): a sentence starts at
             this position, from the model's initial state; source int64 (B,): the row of the state inputs each
             row continues from (read only where resets[:, 0] is false); h0 .. h{L-1} float32 (2, S, P) and
             c0 .. c{L-1} (2, S, C): the state the previous call left in its S rows (directions first);
             positions int64 (N,): flat indices b * W + t of the positions whose vectors come back.
    Outputs: lstm_layers float32 (L, 2, N, P) at `positions` (the backward ones at the reversed positions the
             row read); token_layer float32 (N, P): layer 0, the token vectors at `positions` (the same in both
             halves: the host writes it twice); h0_next .. (2, B, P), c0_next .. (2, B, C): each row's state
             after its last position, for the next call's `source`; token_vectors float32 (U, P).

    Positions after a row's last sentence compute numbers that nothing reads: not `positions`, and not the
    state, since whatever continues in that row next starts with a reset. So nothing is masked, and a row's
    numbers never depend on the other rows. The gates are reordered i, f, o, j, so that one Sigmoid covers the
    three sigmoid gates."""
    if precision not in ("fp32", "fp16"):
        raise ValueError(f"the window graph is written in fp32 or fp16, not {precision!r}")
    opt, g = model.options, _Graph()
    p = _Precision(g, precision)
    i64, f32 = np.int64, TensorProto.FLOAT
    cells, proj = opt.cell_dim, opt.proj_dim

    encoded = _token_encoder(p, model, "token_chars")  # (U, P)
    g.op("Identity", encoded, out=["token_vectors"])
    x = g.op("Gather", g.op("Concat", encoded, "cached_vectors", axis=0), "index")  # (2, B, W, P)
    # reset[t] (1, B, 1): a sentence starts at step t of the row
    split_steps = g.const([1] * window, "steps", i64)
    reset = g.op("Unsqueeze", "resets", g.const([0, 3], "axes", i64))  # (1, B, W, 1)
    reset = g.op("Split", reset, split_steps, axis=2, outputs=window) if window > 1 else [reset]
    reset = [g.op("Squeeze", r, g.const([2], "axis", i64)) for r in reset]

    graph_inputs = [
        helper.make_tensor_value_info("token_chars", TensorProto.INT32, ["tokens", token_width(opt)]),
        helper.make_tensor_value_info("cached_vectors", f32, ["cached", proj]),
        helper.make_tensor_value_info("index", TensorProto.INT64, [2, "rows", window]),
        helper.make_tensor_value_info("resets", TensorProto.BOOL, ["rows", window]),
        helper.make_tensor_value_info("source", TensorProto.INT64, ["rows"]),
    ]
    graph_outputs = []
    layers = [x]  # each (2, B, W, P); layer 0: the token vectors
    for k, pair in enumerate(zip(model.forward_lstm.layers, model.backward_lstm.layers, strict=True)):
        with g.scoped(f"lstm{k}"):
            for kind, size in (("h", proj), ("c", cells)):
                graph_inputs.append(helper.make_tensor_value_info(f"{kind}{k}", f32, [2, "state_rows", size]))
                graph_outputs.append(helper.make_tensor_value_info(f"{kind}{k}_next", f32, [2, "rows", size]))
            out, h, c = _window_layer(p, opt, pair, layers[-1], reset, window, k)
            g.op("Identity", h, out=[f"h{k}_next"])
            g.op("Identity", c, out=[f"c{k}_next"])
            if opt.skip_connections and k > 0:
                out = g.op("Add", out, layers[-1])
        layers.append(out)

    graph_inputs.append(helper.make_tensor_value_info("positions", TensorProto.INT64, ["positions"]))
    axis0 = g.const([0], "axis0", i64)
    # layer 0 is the token vector, the same in both halves of a position: returned once (the forward one), and
    # the host writes both halves, so a third less comes back per call than with both directions' copies
    forward = g.op("Gather", x, g.const(0, "forward", i64), axis=0)  # (B, W, P)
    tokens_flat = g.op("Reshape", forward, g.const([-1, proj], "per_position", i64))
    g.op("Gather", tokens_flat, "positions", axis=0, out=["token_layer"])
    lstm = layers[1:]  # stacked: (L, 2, B, W, P)
    stacked = g.op("Concat", *[g.op("Unsqueeze", x, axis0) for x in lstm], axis=0) if len(lstm) > 1 \
        else g.op("Unsqueeze", lstm[0], axis0)  # fmt: skip
    flat = g.op("Reshape", stacked, g.const([len(lstm), 2, -1, proj], "per_layer", i64))
    g.op("Gather", flat, "positions", axis=2, out=["lstm_layers"])
    graph_outputs.append(helper.make_tensor_value_info("lstm_layers", f32, [len(lstm), 2, "positions", proj]))
    graph_outputs.append(helper.make_tensor_value_info("token_layer", f32, ["positions", proj]))
    graph_outputs.append(helper.make_tensor_value_info("token_vectors", f32, ["tokens", proj]))
    return _model(g, "elmo_bilm_window", graph_inputs, graph_outputs, ms_domain=False)


def _window_layer(p: _Precision, opt, pair, x: str, reset: list[str], window: int, k: int) -> tuple[str, str, str]:
    """One biLSTM layer over a window, both directions at once (a leading axis of 2): x (2, B, W, P) -> its
    outputs (2, B, W, P) and the state after the window, h (2, B, P) and c (2, B, C)."""
    g, i64 = p.g, np.int64
    cells, proj = opt.cell_dim, opt.proj_dim
    order = np.r_[0:cells, 2 * cells : 4 * cells, cells : 2 * cells]  # gates i, j, f, o -> i, f, o, j
    w_input, w_hidden, w_proj, initial_h, initial_c = [], [], [], [], []
    biases = []
    for cell in pair:
        bias = _np(cell.bias)
        bias[2 * cells : 3 * cells] += FORGET_BIAS
        biases.append(bias[None, order])
        w_input.append(_np(cell.w_input)[:, order])
        w_hidden.append(_np(cell.w_hidden)[:, order])
        w_proj.append(_np(cell.w_proj))
        initial_h.append(_np(cell.h0)[None, :])
        initial_c.append(_np(cell.c0)[None, :])
    # every position's input products in one batched product per layer, both directions; then the bias (a column
    # of ones in the product, as the Loop graph has it, would take a Shape and an Expand: values on the host)
    flat = g.op("Reshape", x, g.const([2, -1, proj], "flat", i64))  # (2, B*W, P)
    products = p.up(g.op("MatMul", p.down(flat), p.weight(np.stack(w_input), "w_in")))
    products = g.op("Add", products, g.const(np.stack(biases), "bias"))  # (2, B*W, 4C)
    products = g.op("Reshape", products, g.const([2, -1, window, 4 * cells], "per_step", i64))  # (2, B, W, 4C)
    steps = g.op("Split", products, g.const([1] * window, "steps", i64), axis=2, outputs=window) if window > 1 \
        else [products]  # fmt: skip
    weights = p.weight(np.stack(w_hidden), "w_hidden"), p.weight(np.stack(w_proj), "w_proj")
    h0, c0 = g.const(np.stack(initial_h), "h_initial"), g.const(np.stack(initial_c), "c_initial")  # (2, 1, P|C)
    h = g.op("Gather", f"h{k}", "source", axis=1)  # (2, B, P)
    c = g.op("Gather", f"c{k}", "source", axis=1)
    step_axis, outputs = g.const([2], "axis2", i64), []
    # the three sigmoid gates and the cell input as two Slices, not an unequal Split: CUDA's Split stages its
    # pointers and sizes with small host-to-device copies at every call (a Slice has static bounds)
    starts, middle = g.const([0], "at0", i64), g.const([3 * cells], "at3c", i64)
    ends = g.const([4 * cells], "at4c", i64)
    for t in range(window):
        h, c = g.op("Where", reset[t], h0, h), g.op("Where", reset[t], c0, c)
        gates = g.op("Add", g.op("Squeeze", steps[t], step_axis), p.up(g.op("MatMul", p.down(h), weights[0])))
        sigmoid = g.op("Slice", gates, starts, middle, step_axis)
        j = g.op("Slice", gates, middle, ends, step_axis)
        i, f, o = g.op("Split", g.op("Sigmoid", sigmoid), axis=2, outputs=3)
        c = g.op("Add", g.op("Mul", f, c), g.op("Mul", i, g.op("Tanh", j)))
        if opt.cell_clip:
            c = g.op("Clip", c, g.const(-opt.cell_clip, "lo"), g.const(opt.cell_clip, "hi"))
        h = p.up(g.op("MatMul", p.down(g.op("Mul", o, g.op("Tanh", c))), weights[1]))
        if opt.proj_clip:
            h = g.op("Clip", h, g.const(-opt.proj_clip, "lo"), g.const(opt.proj_clip, "hi"))
        outputs.append(g.op("Unsqueeze", h, step_axis))
    out = g.op("Concat", *outputs, axis=2) if window > 1 else outputs[0]  # (2, B, W, P)
    return out, h, c


def u8_twin(model_proto: onnx.ModelProto) -> onnx.ModelProto:
    """The same int8 graph with each signed 8-bit weight matrix as unsigned (+128, zero point 128): the same
    integers, (a - za)(w + 128 - 128) = (a - za) w, through ONNX Runtime's u8 x u8 kernels, which widen to 16 bits
    before they multiply and so never saturate on any x86 CPU. What a graph of 8-bit activations times s8
    weights computes on a CPU with VNNI or AMX, measured on any CPU (elmo-export states the accuracy of the VNNI
    graph from it); 2-2.5x slower, so never served. Changes `model_proto` in place and returns it."""
    graphs = [model_proto.graph]
    for graph in graphs:
        graphs += [a.g for node in graph.node for a in node.attribute if a.HasField("g")]
    for graph in graphs:
        tensors = {t.name: t for t in graph.initializer}
        for node in graph.node:
            if node.op_type != "MatMulIntegerToFloat" or len(node.input) < 6:
                continue
            for index in (1, 5):  # B and its zero point
                tensor = tensors.get(node.input[index])
                if tensor is not None and tensor.data_type == TensorProto.INT8:
                    shifted = (numpy_helper.to_array(tensor).astype(np.int16) + 128).astype(np.uint8)
                    tensor.CopyFrom(numpy_helper.from_array(shifted, tensor.name))
    return model_proto


def _model(g: _Graph, name: str, inputs: list, outputs: list, ms_domain: bool, functions: list = ()):
    """The model of graph `g`, with the ONNX functions that define this project's ops its nodes use."""
    graph = helper.make_graph(g.nodes, name, inputs, outputs, initializer=g.initializers)
    opsets = [helper.make_opsetid("", OPSET)] + ([helper.make_opsetid(MS_DOMAIN, 1)] if ms_domain else [])
    opsets += [helper.make_opsetid(CELL_DOMAIN, 1)] if functions else []
    model_proto = helper.make_model(graph, opset_imports=opsets, producer_name="elmo-export", functions=functions)
    model_proto.ir_version = IR_VERSION
    return model_proto
