"""The ONNX Runtime engine: token lists in, each sentence's layers out. It owns the sessions and what a call needs
around them (the feeds, the token cache, the window graph's bindings and host memory); which sentences run in a
call, and when, is service/batching/'s.

A model folder holds two graphs of the same biLM (model_export/onnx_graph.py): the Loop graph, fastest on
the CPU, and the window graph (a fixed window of positions unrolled, static shapes), for CUDA and for reduced
precision; the manifest says which file is which (service/manifest.py). Both take the batch as unique tokens +
indices into them (service/engine/feeds.py) and run a window of positions of each sentence from the state its
slot in the engine's state store holds (`step`, driven by service/batching/in_flight.py); `run` runs whole
sentences. The char-CNN runs once per distinct token of a call, and not at all for tokens whose vectors the
engine kept from earlier calls (`TokenCache`: exactly the bits it would compute again). Each sentence is wrapped
in its model family's boundary tokens (<S> ... </S>, or <bos> ... <eos>: service/text/token_ids.py), the way the
biLM was trained, and the boundary positions are cut off again before the vectors are returned (unless asked
for: /embed's `boundaries`, allennlp's keep_sentence_boundaries).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from service.engine.backend import Computed, Segment
from service.engine.feeds import Window, bucket, encode_windows, place, sentence_keys, token_inputs
from service.engine.host_pool import HostPool, cudart, numpy_allocator, pinned_allocator
from service.engine.packing import PackedRows, finite_rows
from service.engine.providers import check_single_runtime, kernels_library, open_graph, session_options
from service.engine.token_cache import TokenCache
from service.manifest import read_manifest
from service.text.token_ids import Mapping


class Engine:
    """An ONNX Runtime session on one graph of an exported model, and the state of the rows in flight.

    The Loop graph (`step`): a window of positions of each row from the state its slot holds (slots 1..max_rows;
    0 is a scratch slot) in a store kept in numpy, which each call leaves holding the state after its window. The
    window graph (`call_packed`): rows packed with sentences, each continuing from a row of the last call's state,
    which stays on the device and is passed by reference (no store rewritten per call). `run` embeds whole
    sentences: never while sentences are in flight (the batcher's retries run after they were cleared). One
    thread at a time may call `step`, `call_packed` or `run` (the batcher's engine thread, or elmo-embed).
    `kernels`: the graphs' ElmoCellStep and ElmoQuantizeRows by this project's kernels where the install built them
    (else, or False, by the standard ops the graph defines them with: the same numbers within 1e-5, slower)."""

    def __init__(
        self,
        model_dir: str | Path,
        provider: str = "auto",
        intra_op_threads: int = 0,
        inter_op_threads: int = 0,
        token_cache: int = 50_000,
        precision: str = "fp32",
        graph: str = "auto",
        device_id: int = 0,
        cuda_graphs: bool = False,
        max_rows: int = 1024,
        kernels: bool = True,
    ):
        check_single_runtime()
        self.info = read_manifest(model_dir)
        self.token_cache = TokenCache(token_cache)
        self.max_rows = max_rows
        options = session_options(intra_op_threads, inter_op_threads, kernels)
        self.kernels = kernels and kernels_library() is not None  # this project's kernels, or their standard ops
        self.graph, self.session = open_graph(self.info, provider, precision, graph, options, device_id, cuda_graphs)
        self.provider = self.session.get_providers()[0]
        self.window = self.graph.window  # positions per call of the window graph; None: any
        self.device = "cuda" if self.provider == "CUDAExecutionProvider" else "cpu"
        self._device_id = device_id
        # The state a call continues from, h and c per layer (and direction): name -> width.
        states = [i for i in self.session.get_inputs() if i.name[0] in "hc" and i.name[1:2] in ("_", *"0123456789")]
        self.state_sizes = {i.name: i.shape[-1] for i in states}
        self._outputs = [output.name for output in self.session.get_outputs()]
        if not self.window:
            self._store = {name: np.zeros((max_rows + 1, size), np.float32) for name, size in self.state_sizes.items()}
        else:
            self._window = _WindowCalls(self, cuda_graphs)

    @property
    def num_layers(self) -> int:
        return self.info.num_layers

    @property
    def dim(self) -> int:
        return self.info.dim

    @property
    def mapping(self) -> Mapping:
        return self.info.mapping

    def run(self, sentences: Sequence[Sequence[str]], boundaries: bool = False) -> list[np.ndarray]:
        """Each sentence's layers, (num_layers, n_tokens, dim) float32, boundary tokens removed (`boundaries`:
        kept, the first and last of n_tokens + 2 positions)."""
        if self.window:
            # a finite batch packed into few enough rows that most calls are full (`finite_rows`), longest first
            # (the rows end together); the numbers do not depend on the rows (packing.py)
            order = sorted(range(len(sentences)), key=lambda i: -len(sentences[i]))
            positions = sum(len(s) + 2 for s in sentences)
            rows = finite_rows(positions, self.window, self._window.row_multiple, self.max_rows)
            packed, results = PackedRows(self, rows, prefetch=True), [None] * len(sentences)
            packed.admit((sentences[i] for i in order), order)
            while packed.busy:
                for sentence in packed.step():
                    results[sentence.tag] = sentence.result(boundaries=boundaries)
            self.run_efficiency = packed.efficiency  # bench.host, bench.gpu
            return results
        results = []
        for first in range(0, len(sentences), self.max_rows):
            chunk = [sentence_keys(s, self.mapping) for s in sentences[first : first + self.max_rows]]
            layers = [np.empty((self.num_layers, len(keys), self.dim), np.float32) for keys in chunk]
            windows = [(keys, 0, len(keys)) for keys in chunk]  # whole sentences in one call
            fwd, bwd = self.step(windows, np.ones(len(chunk), bool), np.arange(1, len(chunk) + 1))
            place(layers, windows, fwd, bwd, self.info.token_dim)
            results += layers if boundaries else [np.ascontiguousarray(a[:, 1:-1]) for a in layers]
        return results

    def step(self, windows: Sequence[Window], start: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The Loop graph: run a window of positions of each row (see `Window`; 0 positions: the row only keeps
        its state), from the model's initial state where `start`, else from the state its slot holds; each slot
        then holds the row's state after its window. Returns the forward and backward layers (L+1, N, P) at the
        windows' positions, row after row (N: their positions together; the backward ones in the reversed order
        they were read in). The char-CNN's new token vectors go to the cache."""
        feeds, encoded = encode_windows(windows, self.mapping, self.info.token_dim, self.token_cache)
        feeds["start"] = start
        for name, rows in self._store.items():
            feeds[name] = rows[slots]
        out = dict(zip(self._outputs, self.session.run(self._outputs, feeds, _run_options()), strict=True))
        for name, rows in self._store.items():
            rows[slots] = out[f"{name}_next"]
        self._cache(encoded, out["token_vectors"])
        lengths = [n for _, _, n in windows]
        return tuple(np.concatenate([out[f"layers_{d}"][:, i, :n] for i, n in enumerate(lengths)], axis=1)
                     for d in ("fwd", "bwd"))  # fmt: skip

    def call_packed(self, rows: list[list[Segment]], source: list[int]) -> Computed:
        """The window graph: one call on packed rows (service/engine/packing.py). Each segment's positions are
        computed, from the model's initial state where its sentence starts, else from the state row `source[b]`
        of the last call left; the call's outputs come back at the segments' positions, one after the other."""
        return self.run_prepared(self.prepare_packed(rows, source))

    def prepare_packed(self, rows: list[list[Segment]], source: list[int]) -> Prepared:
        """The host's side of `call_packed` before the graph runs: its feeds. Reads the sentences' keys and the
        token cache only, so it may run (on another thread) while the previous call runs: a token that call
        encodes is then encoded again here, the same bits."""
        window = self.window
        padded = self._window.rows(len(rows))
        # every position's key, forward and backward, row after row; a row's unused positions read the boundary
        pad = self.mapping.boundaries[0]
        forward, backward, starts, used = [], [], [], []
        for b, segments in enumerate(rows):
            t = 0
            for sentence, first, n in segments:
                keys, end = sentence.keys, sentence.length - first
                forward += keys[first : first + n]
                backward += keys[end - n : end][::-1]
                if first == 0:
                    starts.append(b * window + t)
                t += n
            forward += [pad] * (window - t)
            backward += [pad] * (window - t)
            used.append(t)
        # Tokens in bucket sizes: few shapes for the char-CNN (each new one is planned, and on a GPU searched for
        # its convolution algorithms), and the same products, so the same bits, with or without CUDA graphs.
        feeds, index_of, encoded = token_inputs((forward, backward), self.mapping, self.info.token_dim,
                                                self.token_cache, bucketed=True)  # fmt: skip
        index = np.zeros((2, padded * window), np.int64)  # rows that pad the call read token 0: nothing reads them
        index[0, : len(forward)] = np.fromiter(map(index_of.__getitem__, forward), np.int64, len(forward))
        index[1, : len(backward)] = np.fromiter(map(index_of.__getitem__, backward), np.int64, len(backward))
        feeds["index"] = index.reshape(2, padded, window)
        resets = np.zeros(padded * window, bool)
        resets[starts] = True
        resets[len(rows) * window :: window] = True  # rows that pad the call start afresh
        feeds["resets"] = resets.reshape(padded, window)
        feeds["source"] = np.zeros(padded, np.int64)
        feeds["source"][: len(rows)] = source
        used = np.array(used)
        flat = (np.arange(window) < used[:, None]).nonzero()  # the positions computed for a sentence
        positions = flat[0] * window + flat[1]
        feeds["positions"] = np.zeros(self._window.positions(len(positions), padded), np.int64)  # padding: 0
        feeds["positions"][: len(positions)] = positions
        fresh = all(segments[0][1] == 0 for segments in rows)  # no row continues: the state given is not read
        return Prepared(rows, feeds, encoded, fresh, padded)

    def run_prepared(self, prepared: Prepared) -> Computed:
        """Run a call prepared by `prepare_packed` (calls run in the order they were prepared: each continues
        from the state the one before left): the rows computed and the layers at the segments' positions."""
        (token_layer, lstm), token_vectors = self._window.run(prepared.feeds, prepared.fresh)
        self._cache(prepared.encoded, token_vectors)
        return Computed(prepared.padded, token_layer, lstm)

    def _cache(self, encoded: dict, token_vectors: np.ndarray) -> None:
        """The char-CNN's new token vectors, kept for later calls."""
        for key, row in encoded.items():
            if key not in self.mapping.boundaries:  # never looked up in the cache
                self.token_cache.put(key, token_vectors[row].copy())


@dataclass
class Prepared:
    """A window call's feeds, built ahead of its run (`Engine.prepare_packed`)."""

    rows: list[list[Segment]]
    feeds: dict[str, np.ndarray]
    encoded: dict
    fresh: bool
    padded: int


class _WindowCalls:
    """How the window graph is called: its inputs bound, the state it continues from passed by reference, on the
    device where there is one, and its outputs written once into a block of reused host memory (`HostPool`:
    pinned on CUDA) that the sentences keep views of.

    Uncaptured, the outputs are bound to views of a pooled block: ONNX Runtime writes them there (on CUDA, one copy
    from the device into pinned memory), no array is allocated or filled with zeros for them. With CUDA graphs
    (`fixed`), each bucket of a call (`rows`, `feeds.bucket` for tokens and positions) runs with its inputs and
    outputs in device buffers at fixed addresses, as a captured graph replays them, shared between buckets of the
    same shapes, and its own graph id; its outputs are then copied once into a pooled block. A bucket's key is its
    shapes, the rows of the state it reads and which of that pair of state buffers it reads: the same from call
    to call in steady traffic. On the CPU the same buffers run without a capture (tests)."""

    def __init__(self, engine: Engine, cuda_graphs: bool):
        self.engine, self.fixed = engine, cuda_graphs
        self.device, self.device_id = engine.device, engine._device_id
        self.state_names = list(engine.state_sizes)
        self.state = self._zeros(1)  # what the last call left (nothing yet: a row of zeros, never read)
        self.state_key = (1, 0)  # its rows and which of their pair (the key of the call that reads it)
        self.pairs: dict[int, tuple[dict, dict]] = {}  # rows -> two state buffers of that many rows
        self.bound: dict[tuple, tuple] = {}  # a captured bucket's binding and graph id
        self.buffers: dict[tuple, tuple] = {}  # (name, shape) -> a device buffer and the array over it on the CPU
        self.options: dict[int | None, ort.RunOptions] = {}
        outputs = {o.name for o in engine.session.get_outputs()}
        # graph version 9 returns layer 0 once (`token_layer`); version 8 stacks it with the LSTM layers, both halves
        self.outputs = SPLIT_OUTPUTS if "token_layer" in outputs else STACKED_OUTPUTS
        cuda = self.device == "cuda"
        self.row_multiple = CUDA_ROW_MULTIPLE if cuda else ROW_MULTIPLE
        self.pool = HostPool(pinned_allocator(self.device_id) if cuda else numpy_allocator)
        self._copy = _cuda_copy() if cuda else None

    def rows(self, n: int) -> int:
        """The rows a call of `n` rows is fed as, with or without CUDA graphs (the same shapes, so the same products:
        the same bits either way): a multiple of `row_multiple`; with CUDA graphs a power of two (few buckets)."""
        multiple = self.row_multiple
        rows = -(-n // multiple) * multiple
        return bucket(rows, multiple) if self.fixed else rows

    def positions(self, n: int, rows: int) -> int:
        return bucket(n, 16, rows * self.engine.window) if self.fixed else n

    def _shapes(self, feeds: dict[str, np.ndarray]) -> list[tuple[str, tuple[int, ...]]]:
        """Each output's name and shape (the state's aside)."""
        info = self.engine.info
        n, proj, tokens = len(feeds["positions"]), info.token_dim, len(feeds["token_chars"])
        if self.outputs is SPLIT_OUTPUTS:
            layers = [("lstm_layers", (info.num_layers - 1, 2, n, proj)), ("token_layer", (n, proj))]
        else:
            layers = [("layers", (info.num_layers, 2, n, proj))]
        return [*layers, ("token_vectors", (tokens, proj))]

    def _host_views(self, shapes: list[tuple[str, tuple[int, ...]]]) -> list[np.ndarray]:
        """Views of one pooled block, one per output, in `shapes`' order."""
        sizes = [int(np.prod(shape)) for _, shape in shapes]
        block, at, views = self.pool.take(sum(sizes)), 0, []
        for (_, shape), size in zip(shapes, sizes, strict=True):
            views.append(block[at : at + size].reshape(shape))
            at += size
        return views

    def _answer(self, views: list[np.ndarray]) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
        """(token layer (N, P), LSTM layers (L, 2, N, P)), token vectors: what `call_packed` keeps."""
        if self.outputs is SPLIT_OUTPUTS:
            lstm, token_layer, token_vectors = views
        else:  # layer 0's backward half is its forward half at the same position: the forward one is kept
            stacked, token_vectors = views
            lstm, token_layer = stacked[1:], stacked[0, 0]
        return (token_layer, lstm), token_vectors

    def _zeros(self, rows: int) -> dict[str, ort.OrtValue]:
        sizes = self.engine.state_sizes
        return {name: self._value(np.zeros((2, rows, sizes[name]), np.float32)) for name in self.state_names}

    def _empty(self, rows: int) -> dict[str, ort.OrtValue]:
        """State buffers that are written before they are read: allocated where they live, nothing uploaded."""
        sizes = self.engine.state_sizes
        return {name: self._buffer((2, rows, sizes[name]), np.float32)[0] for name in self.state_names}

    def _buffer(self, shape: tuple[int, ...], dtype) -> tuple[ort.OrtValue, np.ndarray | None]:
        """A buffer on the device, and on the CPU the array it is (to copy from without a second copy)."""
        if self.device == "cpu":
            array = np.empty(shape, dtype)
            return ort.OrtValue.ortvalue_from_numpy(array), array
        return ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, self.device, self.device_id), None

    def _value(self, array: np.ndarray) -> ort.OrtValue:
        return ort.OrtValue.ortvalue_from_numpy(array, self.device, self.device_id)

    def run(self, feeds: dict[str, np.ndarray], fresh: bool) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
        """Run the graph on `feeds`, continuing from the last call's state (unless `fresh`); (the token layer
        (N, P), the LSTM layers (L, 2, N, P)) at the positions asked for, and the token vectors: views of a pooled
        host block."""
        session, rows = self.engine.session, len(feeds["source"])
        shapes = self._shapes(feeds)
        views = self._host_views(shapes)
        if not self.fixed:
            binding = session.io_binding()
            for name, array in feeds.items():
                binding.bind_cpu_input(name, array)
            for name in self.state_names:
                binding.bind_ortvalue_input(name, self.state[name])
            for (name, _), view in zip(shapes, views, strict=True):  # written where the sentences read them
                binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(view))
            for name in self.state_names:
                binding.bind_output(f"{name}_next", self.device, self.device_id)
            session.run_with_iobinding(binding, self._options(None))
            values = binding.get_outputs()
            self.state = dict(zip(self.state_names, values[len(shapes) :], strict=True))
            self.state_key = (rows, 0)
            return self._answer(views)
        pair = self.pairs.get(rows) or self.pairs.setdefault(rows, (self._empty(rows), self._empty(rows)))
        # a fresh call reads nothing: give it the buffer it does not write (its own pair's second)
        given_key = (rows, 1) if fresh else self.state_key
        given = pair[1] if fresh else self.state
        side = 1 if given is pair[0] else 0
        key = (*(array.shape for array in feeds.values()), given_key, side)
        if key not in self.bound and len(self.bound) < CAPTURED_BUCKETS:
            self.bound[key] = self._fixed_binding(feeds, shapes, given, pair[side], len(self.bound) + 1)
        inputs, binding, outputs, graph_id = self.bound.get(key) or self._fixed_binding(
            feeds, shapes, given, pair[side], None
        )
        for name, array in feeds.items():
            inputs[name].update_inplace(array)
        session.run_with_iobinding(binding, self._options(graph_id))
        self.state, self.state_key = pair[side], (rows, side)
        for (value, array), view in zip(outputs, views, strict=True):  # the one copy, into the pooled block
            self._to_host(value, array, view)
        return self._answer(views)

    def _to_host(self, value: ort.OrtValue, array: np.ndarray | None, view: np.ndarray) -> None:
        if array is not None:  # the CPU: the buffer is an array of ours
            np.copyto(view, array)
        elif self._copy is not None:
            self._copy(view, value)
        else:  # no CUDA runtime library to call: ONNX Runtime's copy, then ours
            np.copyto(view, value.numpy())

    def _fixed_binding(self, feeds: dict, shapes: list, given: dict, written: dict, graph_id: int | None) -> tuple:
        """Inputs and outputs in device buffers shared by every bucket of the same shapes, the state bound by
        reference."""
        binding = self.engine.session.io_binding()
        inputs = {}
        for name, array in feeds.items():
            inputs[name] = self._shared(name, array.shape, array.dtype)[0]
            binding.bind_ortvalue_input(name, inputs[name])
        for name in self.state_names:
            binding.bind_ortvalue_input(name, given[name])
        outputs = [self._shared(name, shape, np.float32) for name, shape in shapes]
        for (name, _), (value, _) in zip(shapes, outputs, strict=True):
            binding.bind_ortvalue_output(name, value)
        for name in self.state_names:
            binding.bind_ortvalue_output(f"{name}_next", written[name])
        return inputs, binding, outputs, graph_id

    def _shared(self, name: str, shape: tuple[int, ...], dtype) -> tuple:
        key = (name, tuple(shape), np.dtype(dtype).str)
        if key not in self.buffers:
            self.buffers[key] = self._buffer(tuple(shape), dtype)
        return self.buffers[key]

    @property
    def captured_bytes(self) -> int:
        """Device memory the buckets' fixed buffers hold (inputs, outputs and the state pairs)."""
        held = sum(value.tensor_size_in_bytes() for value, _ in self.buffers.values())
        return held + sum(v.tensor_size_in_bytes() for pair in self.pairs.values() for side in pair
                          for v in side.values())  # fmt: skip

    def _options(self, graph_id: int | None) -> ort.RunOptions:
        """Run options, made once per graph id: with CUDA graphs the bucket's graph id (-1: run uncaptured)."""
        if graph_id not in self.options:
            options = _run_options()
            if self.fixed and self.device == "cuda":
                options.add_run_config_entry("gpu_graph_id", str(-1 if graph_id is None else graph_id))
            self.options[graph_id] = options
        return self.options[graph_id]


def _cuda_copy():
    """copy(view, value): the device buffer `value` into the host array `view` in one cudaMemcpy (ONNX Runtime's
    Python API has no copy into a given host buffer); None where the CUDA runtime library cannot be loaded."""
    import ctypes

    library = cudart()
    if library is None:
        return None
    device_to_host = 2  # cudaMemcpyDeviceToHost

    def copy(view: np.ndarray, value: ort.OrtValue) -> None:
        err = library.cudaMemcpy(ctypes.c_void_p(view.ctypes.data), ctypes.c_void_p(value.data_ptr()),
                                 ctypes.c_size_t(view.nbytes), device_to_host)  # fmt: skip
        if err:
            raise RuntimeError(f"cudaMemcpy from the device failed with error {err}")

    return copy


def _run_options() -> ort.RunOptions:
    """At the warning log level: the session was made at the verbose level to read its placement report."""
    options = ort.RunOptions()
    options.log_severity_level = 2
    return options


# The window graph's outputs (the state's aside): graph version 9 returns layer 0 (the token vectors at the positions,
# the same in both halves) once; version 8 returned it in both halves of a stack with the LSTM layers.
SPLIT_OUTPUTS = ("lstm_layers", "token_layer", "token_vectors")
STACKED_OUTPUTS = ("layers", "token_vectors")
# The window graph's rows are fed in multiples of this on the CPU: ONNX Runtime's CPU MatMul takes another path for
# one row, which rounds otherwise (2.1e-6 on the default model: not the bits of the same sentence in a batch);
# from two rows on the bits are those of any batch (tests/service/engine/test_packing.py). On CUDA one sentence
# runs on one row (batch independence on the device is checked by bench.gpu).
ROW_MULTIPLE = 2
CUDA_ROW_MULTIPLE = 1
# With CUDA graphs, rows go in powers of two (8 .. max_rows) and tokens and positions in `bucket` sizes: few keys,
# which steady traffic repeats. Buckets of the same shapes share their device buffers (the layers of 1024 rows are
# 330 MB on the full-size model); at most CAPTURED_BUCKETS keys are captured (the first ones seen), the rest run
# uncaptured on buffers of the same kind.
CAPTURED_BUCKETS = 64
