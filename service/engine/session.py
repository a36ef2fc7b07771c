"""The ONNX Runtime engine: token lists in, each sentence's layers out. Owns the session and nothing else.

A model folder holds two graphs of the same biLM (model_export/onnx_graph.py): the Loop graph, fastest on
the CPU, and the window graph (a fixed window of positions unrolled, static shapes), for CUDA and for reduced
precision; the manifest says which file is which (service/manifest.py). Both take the batch as unique tokens +
indices into them (service/engine/feeds.py) and run a window of positions of each sentence from the state its
slot in the engine's state store holds (`step`, driven by service/batching/windows.py); `run` runs whole
sentences. The char-CNN runs once per distinct token of a call, and not at all for tokens whose vectors the
engine kept from earlier calls (`TokenCache`: exactly the bits it would compute again). Each sentence is wrapped
in its model family's boundary tokens (<S> ... </S>, or <bos> ... <eos>: service/text/token_ids.py), the way the
biLM was trained, and the boundary positions are cut off again before the vectors are returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from service.engine.feeds import Window, bucket, encode_windows, place, sentence_keys, token_inputs
from service.engine.packing import PackedRows, Segment
from service.engine.providers import check_single_runtime, open_graph, session_options
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
    thread at a time may call `step`, `call_packed` or `run` (the batcher's engine thread, or elmo-embed)."""

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
    ):
        check_single_runtime()
        self.info = read_manifest(model_dir)
        self.token_cache = TokenCache(token_cache)
        self.max_rows = max_rows
        options = session_options(intra_op_threads, inter_op_threads)
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

    def run(self, sentences: Sequence[Sequence[str]]) -> list[np.ndarray]:
        """Each sentence's layers, (num_layers, n_tokens, dim) float32, boundary tokens removed."""
        if self.window:
            packed, results = PackedRows(self), [None] * len(sentences)
            packed.admit(sentences, range(len(sentences)))
            while packed.busy:
                for sentence in packed.step():
                    results[sentence.tag] = sentence.result()
            return results
        results = []
        for first in range(0, len(sentences), self.max_rows):
            chunk = [sentence_keys(s, self.mapping) for s in sentences[first : first + self.max_rows]]
            layers = [np.empty((self.num_layers, len(keys), self.dim), np.float32) for keys in chunk]
            windows = [(keys, 0, len(keys)) for keys in chunk]  # whole sentences in one call
            fwd, bwd = self.step(windows, np.ones(len(chunk), bool), np.arange(1, len(chunk) + 1))
            place(layers, windows, fwd, bwd, self.info.token_dim)
            results += [np.ascontiguousarray(a[:, 1:-1]) for a in layers]
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

    def call_packed(self, rows: list[list[Segment]], source: list[int]) -> int:
        """The window graph: one call on packed rows (service/engine/packing.py). Each segment's positions are
        computed, from the model's initial state where its sentence starts, else from the state row `source[b]`
        of the last call left, and kept in its sentence as a view of this call's output. Returns the rows computed
        (the rows given, padded to the shapes the graph is fed in)."""
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
        layers, token_vectors = self._window.run(feeds, fresh)
        self._cache(encoded, token_vectors)
        q = 0
        for segments in rows:
            for sentence, first, n in segments:
                sentence.pieces.append((first, n, layers, q))
                sentence.done = first + n
                q += n
        return padded

    def _cache(self, encoded: dict, token_vectors: np.ndarray) -> None:
        """The char-CNN's new token vectors, kept for later calls."""
        for key, row in encoded.items():
            if key not in self.mapping.boundaries:  # never looked up in the cache
                self.token_cache.put(key, token_vectors[row].copy())


class _WindowCalls:
    """How the window graph is called: its inputs bound, and the state it continues from passed by reference,
    on the device where there is one. With CUDA graphs (`fixed`), each shape of a call (at most CAPTURED_BUCKETS
    shapes of up to CAPTURED_ROWS rows) runs with buffers at fixed addresses, as a captured graph
    replays them, and its own graph id; its state goes to one of a pair of buffers of its size, the one the call
    does not read. On the CPU the same buffers run without a capture (tests)."""

    def __init__(self, engine: Engine, cuda_graphs: bool):
        self.engine, self.fixed = engine, cuda_graphs
        self.device, self.device_id = engine.device, engine._device_id
        self.state_names = list(engine.state_sizes)
        self.state = self._zeros(1)  # what the last call left (nothing yet: a row of zeros, never read)
        self.pairs: dict[int, tuple[dict, dict]] = {}  # rows -> two state buffers of that many rows
        self.bound: dict[tuple, tuple] = {}  # a captured bucket's fixed buffers, binding and graph id
        self.options: dict[int | None, ort.RunOptions] = {}

    @staticmethod
    def rows(n: int) -> int:
        """The rows a call of `n` rows is fed as: a multiple of ROW_MULTIPLE, with or without CUDA graphs (the same
        shapes, so the same products: the same bits either way)."""
        return -(-n // ROW_MULTIPLE) * ROW_MULTIPLE

    def positions(self, n: int, rows: int) -> int:
        return bucket(n, 16, rows * self.engine.window) if self.fixed else n

    def _host_outputs(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        engine = self.engine
        layers = np.empty((engine.num_layers, 2, len(feeds["positions"]), engine.info.token_dim), np.float32)
        return layers, np.empty((len(feeds["token_chars"]), engine.info.token_dim), np.float32)

    def _zeros(self, rows: int) -> dict[str, ort.OrtValue]:
        sizes = self.engine.state_sizes
        return {name: self._value(np.zeros((2, rows, sizes[name]), np.float32)) for name in self.state_names}

    def _value(self, array: np.ndarray) -> ort.OrtValue:
        return ort.OrtValue.ortvalue_from_numpy(array, self.device, self.device_id)

    def run(self, feeds: dict[str, np.ndarray], fresh: bool) -> tuple[np.ndarray, np.ndarray]:
        """Run the graph on `feeds`, continuing from the last call's state (unless `fresh`); the layers (L+1, 2,
        N, P) at the positions asked for, and the token vectors."""
        session, rows = self.engine.session, len(feeds["source"])
        if not self.fixed:
            binding = session.io_binding()
            for name, array in feeds.items():
                binding.bind_cpu_input(name, array)
            for name in self.state_names:
                binding.bind_ortvalue_input(name, self.state[name])
            # the layers and token vectors into arrays of our own, on the host: what the sentences keep views of
            host = self._host_outputs(feeds)
            for name, array in zip(LAYER_OUTPUTS, host, strict=True):
                binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(array))
            for name in self.state_names:
                binding.bind_output(f"{name}_next", self.device, self.device_id)
            session.run_with_iobinding(binding, self._options(None))
            values = binding.get_outputs()
            self.state = dict(zip(self.state_names, values[len(LAYER_OUTPUTS) :], strict=True))
            return host
        pair = self.pairs.get(rows) or self.pairs.setdefault(rows, (self._zeros(rows), self._zeros(rows)))
        given = pair[1] if fresh else self.state  # a fresh call reads nothing: give it the buffer it does not write
        written = pair[1] if given is pair[0] else pair[0]
        key = (*(array.shape for array in feeds.values()), id(given))
        captured = key in self.bound or (len(self.bound) < CAPTURED_BUCKETS and rows <= CAPTURED_ROWS)
        if captured and key not in self.bound:
            self.bound[key] = self._fixed_binding(feeds, given, written)
        if captured:
            inputs, binding, outputs, graph_id = self.bound[key]
            for name, array in feeds.items():
                inputs[name].update_inplace(array)
        else:
            inputs, binding, outputs, _ = self._fixed_binding(feeds, given, written)
            graph_id = None
        session.run_with_iobinding(binding, self._options(graph_id))
        self.state = written
        # copies of this call's outputs: the sentences keep views of them, and the buffers are written again
        return tuple(np.array(value.numpy()) for value in outputs)

    def _fixed_binding(self, feeds: dict[str, np.ndarray], given: dict, written: dict) -> tuple:
        """Inputs copied to buffers of their own, the state bound by reference, outputs to buffers of their own."""
        engine = self.engine
        inputs = {name: self._value(array) for name, array in feeds.items()}
        binding = engine.session.io_binding()
        for name, value in inputs.items():
            binding.bind_ortvalue_input(name, value)
        for name in self.state_names:
            binding.bind_ortvalue_input(name, given[name])
        layer_shape = (engine.num_layers, 2, len(feeds["positions"]), engine.info.token_dim)
        outputs = [self._value(np.zeros(layer_shape, np.float32)),
                   self._value(np.zeros((len(feeds["token_chars"]), engine.info.token_dim), np.float32))]  # fmt: skip
        for name, value in zip(LAYER_OUTPUTS, outputs, strict=True):
            binding.bind_ortvalue_output(name, value)
        for name in self.state_names:
            binding.bind_ortvalue_output(f"{name}_next", written[name])
        return inputs, binding, outputs, len(self.bound) + 1  # graph ids from 1: 0 is the default

    def _options(self, graph_id: int | None) -> ort.RunOptions:
        """Run options, made once per graph id: with CUDA graphs the bucket's graph id (-1: run uncaptured)."""
        if graph_id not in self.options:
            options = _run_options()
            if self.fixed and self.device == "cuda":
                options.add_run_config_entry("gpu_graph_id", str(-1 if graph_id is None else graph_id))
            self.options[graph_id] = options
        return self.options[graph_id]


def _run_options() -> ort.RunOptions:
    """At the warning log level: the session was made at the verbose level to read its placement report."""
    options = ort.RunOptions()
    options.log_severity_level = 2
    return options


LAYER_OUTPUTS = ("layers", "token_vectors")
# The window graph's rows are fed in multiples of this: few shapes, little padding, and no product of fewer rows
# (ONNX Runtime's CPU kernels take another path for a row or two, which rounds otherwise).
ROW_MULTIPLE = 8
# CUDA graphs pay where kernel launches dominate, at few rows; each captured bucket keeps its own buffers (the layers
# of 1024 rows are 200 MB on the full-size model), so only buckets of up to CAPTURED_ROWS rows are captured, and at
# most CAPTURED_BUCKETS of them (the first ones seen); the rest run uncaptured.
CAPTURED_ROWS, CAPTURED_BUCKETS = 64, 32
