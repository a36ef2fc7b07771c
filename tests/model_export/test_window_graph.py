"""The window graph (the GPU's): positions unrolled, padding masked, static shapes, state in slots. Exact
against allennlp and PyTorch on the CPU, window by window as whole, whatever else is in the batch; its fp16
variant close to fp32; what a CUDA session needs (no Loop, nothing that sends values to the host, a bounded
set of shapes, every node on the GPU) checked here where it can be without a GPU."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from service.batching.in_flight import in_flight
from service.engine.canary import cosine_min
from service.engine.feeds import bucket
from service.engine.providers import nodes_off, placed_session
from service.engine.session import Engine
from tests.conftest import max_error
from tests.service.batching.test_in_flight import staggered

WINDOW = 32  # what elmo-export writes


@pytest.fixture(scope="module")
def window_engine(tiny_model_dir) -> Engine:
    return Engine(tiny_model_dir, provider="cpu", graph="window", intra_op_threads=2)


def test_the_folder_holds_five_graphs_and_says_which_is_which(tiny_model_dir):
    graphs = json.loads((tiny_model_dir / "manifest.json").read_text())["graphs"]
    assert [(g["file"], g["kind"], g["precision"], g["window"]) for g in graphs] == [
        ("model.onnx", "loop", "fp32", None),
        ("model_int8.onnx", "loop", "int8", None),
        ("model_window.onnx", "window", "fp32", WINDOW),
        ("model_window_fp16.onnx", "window", "fp16", WINDOW),
        ("model_int8_vnni.onnx", "loop", "int8", None),  # for CPUs with VNNI or AMX: tests/model_export/test_int8.py
    ]
    assert graphs[0]["parity"]["max_abs_error"] <= 1e-5 and graphs[2]["parity"]["max_abs_error"] <= 1e-5
    assert graphs[1]["accuracy"]["min_cosine_vs_fp32"] >= 0.999  # tests/model_export/test_int8.py
    assert graphs[3]["accuracy"]["min_cosine_vs_fp32"] >= 0.9999


def test_the_engine_picks_the_loop_graph_on_the_cpu_and_the_window_graph_for_fp16(tiny_model_dir, engine):
    assert (engine.graph.kind, engine.window) == ("loop", None)
    half = Engine(tiny_model_dir, provider="cpu", precision="fp16")
    assert (half.graph.kind, half.graph.precision, half.window) == ("window", "fp16", WINDOW)


def test_window_graph_matches_allennlp_on_every_layer(window_engine, sentences, expected):
    assert max(len(s) for s in sentences) + 2 > WINDOW  # the longest sentences take two windows
    assert max_error(window_engine.run(sentences), expected) <= 1e-5


def test_window_graph_is_the_loop_graphs_numbers(window_engine, engine, sentences):
    assert max_error(window_engine.run(sentences), engine.run(sentences)) <= 1e-6


def test_a_sentence_alone_is_the_same_bits_as_in_any_batch(window_engine, sentences):
    together = window_engine.run(sentences)
    beside_a_long_one = window_engine.run([["x"] * 300, *sentences[:5]])[1:]
    for i, sentence in enumerate(sentences[:5]):
        alone = window_engine.run([sentence])[0]
        np.testing.assert_array_equal(alone, together[i])
        np.testing.assert_array_equal(alone, beside_a_long_one[i])


def test_rows_joining_between_windows_get_the_bits_of_a_whole_run(window_engine, sentences):
    want = window_engine.run(sentences)
    got, windows = staggered(in_flight(window_engine, 8), sentences, seed=1)
    assert windows >= 2  # the longest sentence took two windows of 32 at least
    for i, w in enumerate(want):
        np.testing.assert_array_equal(got[i], w)


def test_the_stepper_advances_by_the_graphs_window(window_engine):
    assert in_flight(window_engine, 8).window == WINDOW  # the graph computes 32 positions whatever is asked
    rows = in_flight(window_engine, 8)
    rows.admit([["a"] * 40], [0])
    assert rows.step(window=3) == [] and rows.rows[0].position == WINDOW


def test_rows_are_bounded_by_max_rows_and_those_waiting_by_what_a_call_can_start(tiny_model_dir):
    small = Engine(tiny_model_dir, provider="cpu", graph="window", max_rows=4)
    rows = in_flight(small, 8)
    room = rows.room
    assert room == 4 * WINDOW // 3  # a sentence is at least 3 positions: a call starts no more than this
    rows.admit([["a"]] * room, range(room))
    assert rows.room == 0
    with pytest.raises(ValueError, match="room for 0"):
        rows.admit([["b"]], [room])
    planned, _ = rows.packed.plan()
    assert len(planned) == 4  # rows: at most max_rows
    finished = len(rows.step())  # 3 positions each: 10 in each row of 32, the 11th starts and continues
    assert finished == 4 * 10 - 1 and finished + len(rows.step()) == room and rows.room == room
    many = [["w"] * (i % 7 + 1) for i in range(11)]
    assert max_error(small.run(many), Engine(tiny_model_dir, provider="cpu").run(many)) <= 1e-6


def test_fixed_buffers_per_bucket_give_the_same_numbers(tiny_model_dir, window_engine, sentences):
    # What a captured CUDA graph replays: every bucket bound once to buffers at fixed addresses, updated in place,
    # reading one state store and writing the other. The capture itself needs a GPU; the bindings run here.
    fixed = Engine(tiny_model_dir, provider="cpu", graph="window", cuda_graphs=True)
    for _ in range(2):
        assert max_error(fixed.run(sentences), window_engine.run(sentences)) == 0.0
    assert max_error(fixed.run(sentences[:3]), window_engine.run(sentences[:3])) == 0.0
    got, _ = staggered(in_flight(fixed, 8), sentences, seed=2)
    np.testing.assert_array_equal(got[7], window_engine.run([sentences[7]])[0])
    assert 0 < len(fixed._window.bound) <= 24  # a few shapes (three kinds of traffic), reused: not one per call


def test_buckets_are_few_powers_of_two_sharing_their_buffers(tiny_model_dir, window_engine, sentences):
    # Rows go in powers of two with CUDA graphs, so a batch and its drain use a handful of buckets,
    # and buckets of the same shapes share their device buffers (what the captures hold is counted).
    fixed = Engine(tiny_model_dir, provider="cpu", graph="window", cuda_graphs=True)
    many = sentences * 8  # 240 sentences: on 32 rows (engine.run's finite_rows), then fewer as they finish
    assert max_error(fixed.run(many), window_engine.run(many)) == 0.0
    rows = {key[2][1] for key in fixed._window.bound}  # index (2, rows, window)
    assert rows <= {8, 16, 32, 64, 128, 256} and len(rows) >= 2
    buffers = len(fixed._window.buffers)
    shapes = {key[:-2] for key in fixed._window.bound}  # keys that differ only in the state they read share all
    assert buffers < len(shapes) * 9  # 6 inputs and 3 outputs a shape if buckets of the same rows shared none
    held = fixed._window.captured_bytes
    assert held >= sum(a.nbytes for _, a in fixed._window.buffers.values())
    fixed.run(many)  # again, with the token cache warm: fewer tokens to encode, other token buckets
    keys, buffers = len(fixed._window.bound), len(fixed._window.buffers)
    fixed.run(many)  # the same traffic again: the same keys (no id of a buffer in them), no new buffer
    assert len(fixed._window.bound) == keys and len(fixed._window.buffers) == buffers


def test_fp16_stays_close_to_fp32(tiny_model_dir, window_engine, sentences):
    half = Engine(tiny_model_dir, provider="cpu", precision="fp16")
    got, want = half.run(sentences), window_engine.run(sentences)
    assert max_error(got, want) <= 1e-2 and cosine_min(got, want) >= 0.9999
    model = onnx.load(str(half.graph.file))
    assert any(i.data_type == onnx.TensorProto.FLOAT16 for i in model.graph.initializer)
    assert all(i.type.tensor_type.elem_type != onnx.TensorProto.FLOAT16 for i in model.graph.output)


def test_the_window_graph_has_nothing_a_cuda_graph_cannot_hold(tiny_model_dir):
    for name in ("model_window.onnx", "model_window_fp16.onnx"):
        model = onnx.load(str(tiny_model_dir / name))
        ops = {node.op_type for node in model.graph.node}
        # no control flow (run from the host), no op whose output shape depends on values (read on the host)
        assert not ops & {"Loop", "If", "Scan", "NonZero", "Shape", "TopK", "Range", "Expand", "ConstantOfShape"}
        index = next(i for i in model.graph.input if i.name == "index")
        assert [d.dim_value or d.dim_param for d in index.type.tensor_type.shape.dim] == [2, "rows", WINDOW]
        # no unequal Split (CUDA's stages its sizes with host copies each call): the gates are two Slices a step
        consts = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
        for node in model.graph.node:
            if node.op_type == "Split" and len(node.input) > 1:
                assert len(set(consts[node.input[1]].tolist())) == 1, node.name
        assert sum(node.op_type == "Slice" for node in model.graph.node) == 2 * WINDOW * 2  # two layers, a pair a step
        # layer 0 returned once, the LSTM layers in both directions
        assert [o.name for o in model.graph.output][-3:] == ["lstm_layers", "token_layer", "token_vectors"]


def test_buckets_are_powers_of_two_within_bounds():
    assert [bucket(n) for n in (0, 1, 16, 17, 100, 1000)] == [16, 16, 16, 32, 128, 1024]
    assert [bucket(n, 1, 1024) for n in (1, 3, 33, 1000, 1024)] == [1, 4, 64, 1024, 1024]
    assert bucket(700, 1, 600) == 600  # the top bucket is the slot count


def test_placement_of_a_real_cpu_session_is_read_from_its_log(tiny_model_dir):
    options = ort.SessionOptions()
    session, log = placed_session(tiny_model_dir / "model_window.onnx", options, ["CPUExecutionProvider"])
    assert session.get_providers() == ["CPUExecutionProvider"]
    assert "placed on [CPUExecutionProvider]" in log
    assert nodes_off(log, "CPUExecutionProvider") == []


def test_nodes_placed_off_the_gpu_are_named():
    # Recorded in ONNX Runtime's verbose format: a CUDA session cannot start here (no GPU).
    log = "\n".join(
        [
            "[V:onnxruntime:, session_state.cc:1598 VerifyEachNodeIsAssignedToAnEp] Node placements",
            "[V:onnxruntime:, session_state.cc:1601 VerifyEachNodeIsAssignedToAnEp]  Node(s) placed on "
            "[CUDAExecutionProvider]. Number of nodes: 2",
            "[V:onnxruntime:, session_state.cc:1603 VerifyEachNodeIsAssignedToAnEp]   MatMul (matmul_3)",
            "[V:onnxruntime:, session_state.cc:1603 VerifyEachNodeIsAssignedToAnEp]   Gemm (gemm_4)",
            "[V:onnxruntime:, session_state.cc:1601 VerifyEachNodeIsAssignedToAnEp]  Node(s) placed on "
            "[CPUExecutionProvider]. Number of nodes: 1",
            "[V:onnxruntime:, session_state.cc:1603 VerifyEachNodeIsAssignedToAnEp]   Less (less_7)",
        ]
    )
    assert nodes_off(log, "CUDAExecutionProvider") == ["Less (less_7) on CPUExecutionProvider"]
    assert nodes_off(log.replace("CPUExecutionProvider", "CUDAExecutionProvider"), "CUDAExecutionProvider") == []
    everything_on_the_cpu = (
        "[V:onnxruntime:, session_state.cc:1601 VerifyEachNodeIsAssignedToAnEp]  All nodes placed on "
        "[CPUExecutionProvider]. Number of nodes: 812"
    )
    assert nodes_off(everything_on_the_cpu, "CUDAExecutionProvider") == ["all 812 nodes on CPUExecutionProvider"]
    assert nodes_off("no placement report in this log", "CUDAExecutionProvider") is None  # unchecked, not "fine"
