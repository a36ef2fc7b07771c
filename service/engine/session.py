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

from service.engine.feeds import Window, bucket, encode_windows, place, sentence_keys
from service.engine.providers import check_single_runtime, open_graph, session_options
from service.engine.token_cache import TokenCache
from service.manifest import read_manifest
from service.text.token_ids import Mapping


class Engine:
    """An ONNX Runtime session on one graph of an exported model, and the state store of the rows in flight.

    `step` runs a window of positions of each row from the state its slot holds (slots 1..max_rows; 0 is a
    scratch slot for the rows that pad a batch to its bucket) and leaves each slot holding the state after
    its window; on CUDA the store never leaves the device. `run` embeds whole sentences with it, in slots
    1..n: never while a InFlight has rows in flight (the batcher's retries run after `InFlight.clear`). One thread
    at a time may call `step` or `run` (the batcher's engine thread, or elmo-embed)."""

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
        # The state each window continues from, h and c per layer and direction: name -> width.
        self.state_sizes = {i.name: i.shape[1] for i in self.session.get_inputs() if i.name[:2] in ("h_", "c_")}
        self._outputs = [output.name for output in self.session.get_outputs()]
        self.device = "cuda" if self.provider == "CUDAExecutionProvider" else "cpu"
        self._device_id = device_id
        # Fixed buffers per bucket, as a captured CUDA graph replays them; on the CPU too (tests), without capture.
        self._fixed_buffers = bool(cuda_graphs and self.window)
        self._store = self._new_store(max_rows + 1)
        self._spare = self._new_store(max_rows + 1) if self.window else None  # the window graph writes here
        self._bound: dict[tuple, tuple] = {}  # CUDA graphs: a bucket's fixed buffers and binding
        self._options: dict[int | None, ort.RunOptions] = {}  # by graph id (`_run_options`)

    @property
    def num_layers(self) -> int:
        return self.info.num_layers

    @property
    def dim(self) -> int:
        return self.info.dim

    @property
    def mapping(self) -> Mapping:
        return self.info.mapping

    def _new_store(self, slots: int) -> dict:
        """Each state's rows by slot: numpy arrays for the Loop graph, ONNX Runtime values (on the device where
        there is one) for the window graph, which reads one store and writes the other."""
        zeros = {name: np.zeros((slots, size), np.float32) for name, size in self.state_sizes.items()}
        if not self.window:
            return zeros
        return {name: ort.OrtValue.ortvalue_from_numpy(z, self.device, self._device_id) for name, z in zeros.items()}

    def run(self, sentences: Sequence[Sequence[str]]) -> list[np.ndarray]:
        """Each sentence's layers, (num_layers, n_tokens, dim) float32, boundary tokens removed."""
        results = []
        for first in range(0, len(sentences), self.max_rows):
            chunk = [sentence_keys(s, self.mapping) for s in sentences[first : first + self.max_rows]]
            layers = [np.empty((self.num_layers, len(keys), self.dim), np.float32) for keys in chunk]
            slots, done = np.arange(1, len(chunk) + 1), 0
            while done < max(map(len, chunk)):  # whole sentences in one call, or window after window
                windows = [(keys, done, max(0, min(self.window or len(keys), len(keys) - done))) for keys in chunk]
                fwd, bwd = self.step(windows, np.full(len(chunk), done == 0), slots)
                place(layers, windows, fwd, bwd, self.info.token_dim)
                done += self.window or max(map(len, chunk))
            results += [np.ascontiguousarray(a[:, 1:-1]) for a in layers]
        return results

    def step(self, windows: Sequence[Window], start: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Run a window of positions of each row (see `Window`; 0 positions: the row only keeps its state), from
        the model's initial state where `start`, else from the state its slot holds; each slot then holds the
        row's state after its window. Returns the forward and backward layers (L+1, N, P) at the windows'
        positions, row after row (N: their positions together; the backward ones in the reversed order they
        were read in). The char-CNN's new token vectors go to the cache."""
        if self.window:
            fwd, bwd, token_vectors, encoded = self._step_window(windows, start, slots)
        else:
            fwd, bwd, token_vectors, encoded = self._step_loop(windows, start, slots)
        for key, row in encoded.items():
            if key not in self.mapping.boundaries:  # never looked up in the cache
                self.token_cache.put(key, token_vectors[row].copy())
        return fwd, bwd

    def _step_loop(self, windows, start, slots):
        feeds, encoded = encode_windows(windows, self.mapping, self.info.token_dim, self.token_cache)
        feeds["start"] = start
        for name, rows in self._store.items():
            feeds[name] = rows[slots]
        out = dict(zip(self._outputs, self.session.run(self._outputs, feeds, self._run_options(None)), strict=True))
        for name, rows in self._store.items():
            rows[slots] = out[f"{name}_next"]
        lengths = [n for _, _, n in windows]
        fwd, bwd = (np.concatenate([out[f"layers_{d}"][:, i, :n] for i, n in enumerate(lengths)], axis=1)
                    for d in ("fwd", "bwd"))  # fmt: skip
        return fwd, bwd, out["token_vectors"], encoded

    def _step_window(self, windows, start, slots):
        rows, window = bucket(len(windows), 1, self.max_rows), self.window
        feeds, encoded = encode_windows(
            windows, self.mapping, self.info.token_dim, self.token_cache, shape=(rows, window), bucketed=True
        )
        steps = feeds.pop("lengths")
        n = int(steps.sum())
        feeds["steps"] = steps
        feeds["start"] = np.ones(rows, bool)  # rows that pad the bucket start afresh, in the scratch slot
        feeds["start"][: len(windows)] = start
        feeds["slots"] = np.zeros(rows, np.int64)
        feeds["slots"][: len(windows)] = slots
        positions = np.zeros(bucket(n, 16, rows * window), np.int64)  # padded with position 0: cut off below
        positions[:n] = (np.arange(rows)[:, None] * window + np.arange(window))[np.arange(window) < steps[:, None]]
        feeds["positions"] = positions
        binding, graph_id, outputs = self._binding(feeds)
        self.session.run_with_iobinding(binding, self._run_options(graph_id))
        self._store, self._spare = self._spare, self._store
        fwd, bwd, token_vectors = (value.numpy() for value in outputs or binding.get_outputs()[-3:])
        return fwd[:, :n], bwd[:, :n], token_vectors, encoded

    def _binding(self, feeds: dict[str, np.ndarray]) -> tuple[ort.IOBinding, int | None, list | None]:
        """Bind a window's inputs and outputs: the state stores by reference (the graph reads one and writes
        the other, on the device), the rest copied in and the layers copied out. With CUDA graphs, every bucket
        (its shapes, and which store it reads; at most CAPTURED_BUCKETS of up to CAPTURED_ROWS rows) has its own
        buffers at fixed addresses, as a captured graph needs, updated in place, and its own graph id; else ONNX
        Runtime allocates the outputs (None)."""
        key = (id(self._store), *(array.shape for array in feeds.values()))
        captured = key in self._bound or (len(self._bound) < CAPTURED_BUCKETS and len(feeds["steps"]) <= CAPTURED_ROWS)
        if not (self._fixed_buffers and captured):
            binding = self.session.io_binding()
            for name, array in feeds.items():
                binding.bind_cpu_input(name, array)
            self._bind_stores(binding)
            for name in LAYER_OUTPUTS:
                binding.bind_output(name, "cpu")
            return binding, None, None
        if key not in self._bound:
            inputs = {name: self._device_value(array) for name, array in feeds.items()}
            binding = self.session.io_binding()
            for name, value in inputs.items():
                binding.bind_ortvalue_input(name, value)
            self._bind_stores(binding)
            outputs = []
            for name in LAYER_OUTPUTS:
                if name == "token_vectors":
                    shape = (len(feeds["token_chars"]), self.info.token_dim)
                else:
                    shape = (self.num_layers, len(feeds["positions"]), self.info.token_dim)
                outputs.append(self._device_value(np.zeros(shape, np.float32)))
                binding.bind_ortvalue_output(name, outputs[-1])
            self._bound[key] = (inputs, binding, outputs, len(self._bound) + 1)  # ids from 1: 0 is the default
        inputs, binding, outputs, graph_id = self._bound[key]
        for name, array in feeds.items():
            inputs[name].update_inplace(array)
        return binding, graph_id, outputs

    def _run_options(self, graph_id: int | None) -> ort.RunOptions:
        """Run options, made once per graph id: at the warning log level (the session was made at the verbose
        level to read its placement report), and with CUDA graphs the bucket's graph id (-1: run uncaptured)."""
        if graph_id not in self._options:
            options = ort.RunOptions()
            options.log_severity_level = 2
            if self._fixed_buffers and self.device == "cuda":
                options.add_run_config_entry("gpu_graph_id", str(-1 if graph_id is None else graph_id))
            self._options[graph_id] = options
        return self._options[graph_id]

    def _device_value(self, array: np.ndarray) -> ort.OrtValue:
        return ort.OrtValue.ortvalue_from_numpy(array, self.device, self._device_id)

    def _bind_stores(self, binding: ort.IOBinding) -> None:
        for name in self.state_sizes:
            binding.bind_ortvalue_input(name, self._store[name])
            binding.bind_ortvalue_output(f"{name}_next", self._spare[name])


LAYER_OUTPUTS = ("layers_fwd", "layers_bwd", "token_vectors")
# CUDA graphs pay where kernel launches dominate, at few rows; each captured bucket keeps its own buffers (the layers
# of 1024 rows are 200 MB on the full-size model), so only buckets of up to CAPTURED_ROWS rows are captured, and at
# most CAPTURED_BUCKETS of them (the first ones seen); the rest run uncaptured.
CAPTURED_ROWS, CAPTURED_BUCKETS = 64, 32
