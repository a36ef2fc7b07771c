"""The ONNX Runtime engine: token lists in, each sentence's layers out. Owns the session and nothing else.

A model folder holds two graphs of the same biLM (model_export/onnx_graph.py): the Loop graph, fastest on
the CPU, and the window graph (a fixed window of positions unrolled, static shapes), for CUDA and for reduced
precision; the manifest says which file is which. Both take the batch as unique tokens + indices into them
and run a window of positions of each sentence from the state its slot in the engine's state store holds
(`step`, service/stepper.py); `run` runs whole sentences. The char-CNN runs once per distinct token of a
call, and not at all for tokens whose vectors the engine kept from earlier calls (`TokenCache`: exactly the
bits it would compute again). Each sentence is wrapped in its model family's boundary tokens (<S> ... </S>, or
<bos> ... <eos>: service/mapping.py), the way the biLM was trained, and the boundary positions are cut off again
before the vectors are returned.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import re
import sys
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
import onnxruntime as ort

from service.mapping import Mapping, load_mapping

log = logging.getLogger("elmo.engine")
MANIFEST = "manifest.json"
# The graph this engine feeds (model_export/onnx_graph.py writes it): bumped whenever the graph changes (inputs,
# outputs or what it computes fast), or what the engine must feed it; an export of another version is refused.
# 7: the manifest's token_mapping (an ELMoForManyLangs export reads other ids, which an engine of version 6 would
# feed bytes to). An export of version 6 is the same graph with the published byte mapping, and is still served.
GRAPH_VERSION = 7
READABLE_GRAPH_VERSIONS = (6, 7)


class TokenCache:
    """Token vectors (the char-CNN's output) of recently seen tokens, at most `size`, least recent out first.

    A token's vector depends on its row alone (the cache's key is the mapping's `key`: at most 48 bytes or
    characters however long the token; service/mapping.py), and the graph computes it with the same bits in any
    batch, so a cached vector equals a recomputed one exactly: the cache saves the char-CNN's share of the work
    (about a quarter of the model) for frequent words and changes no output."""

    def __init__(self, size: int):
        self.size = size
        self._vectors: OrderedDict[Hashable, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._vectors)

    def get(self, key: Hashable) -> np.ndarray | None:
        with self._lock:
            vector = self._vectors.get(key)
            if vector is not None:
                self._vectors.move_to_end(key)
            return vector

    def put(self, key: Hashable, vector: np.ndarray) -> None:
        if self.size <= 0:
            return
        with self._lock:
            self._vectors[key] = vector
            self._vectors.move_to_end(key)
            while len(self._vectors) > self.size:
                self._vectors.popitem(last=False)


def sentence_keys(sentence: Sequence[str], mapping: Mapping) -> list[Hashable]:
    """The sentence as the biLM reads it: the begin boundary, each token's key (service/mapping.py), the end one."""
    begin, end = mapping.boundaries
    return [begin, *(mapping.key(token) for token in sentence), end]


Window = tuple[Sequence[Hashable], int, int]  # a sentence's keys (`sentence_keys`), first position, positions


def encode_windows(
    windows: Sequence[Window],
    mapping: Mapping,
    dim: int,
    cache: TokenCache | None = None,
    shape: tuple[int, int] | None = None,
    bucketed: bool = False,
) -> tuple[dict[str, np.ndarray], dict[Hashable, int]]:
    """The graph's token inputs for a window of positions of each sentence, and what it will encode
    (`char_key` -> row of `token_vectors`).

    The backward direction reads positions first..first+n-1 of the sentence reversed. Each distinct key
    appears once (tokens that differ only past the kept bytes share one): encoded from its chars
    (`token_chars`), or taken from the cache (`cached_vectors`); at least one row is encoded. `shape`
    (rows, steps) pads the index inputs to that shape (the window graph's bucket), and `bucketed` pads the
    encoded and the cached tokens to a `bucket` size (rows of id 0 and zero vectors, never read)."""
    forward = [keys[first : first + n] for keys, first, n in windows]
    backward = [keys[len(keys) - first - n : len(keys) - first][::-1] for keys, first, n in windows]
    encode: dict[Hashable, int] = {}
    cached: dict[Hashable, int] = {}
    cached_vectors: list[np.ndarray] = []
    for key in itertools.chain(*forward, *backward):
        if key in encode or key in cached:
            continue
        vector = cache.get(key) if cache is not None else None
        if vector is None:
            encode[key] = len(encode)
        else:
            cached[key] = len(cached_vectors)
            cached_vectors.append(vector)
    if not encode:  # the graph's char-CNN needs a row
        encode[mapping.boundaries[0]] = 0
    chars = np.stack([mapping.row(key) for key in encode])
    if bucketed:
        chars = np.concatenate([chars, np.zeros((bucket(len(chars)) - len(chars), mapping.width), np.int32)])
        cached_vectors += [np.zeros(dim, np.float32)] * (bucket(len(cached_vectors)) - len(cached_vectors))
    offset = len(chars)  # the indices count the encoded rows first, then the cached ones

    rows, steps = shape or (len(windows), max(n for _, _, n in windows))
    lengths = np.zeros(rows, np.int64)
    lengths[: len(windows)] = [n for _, _, n in windows]
    feeds = {
        "token_chars": chars,
        "cached_vectors": np.stack(cached_vectors) if cached_vectors else np.zeros((0, dim), np.float32),
        "lengths": lengths,
    }
    for name, rows_keys in (("index_fwd", forward), ("index_bwd", backward)):
        index = np.zeros((rows, steps), dtype=np.int64)  # padding points at row 0: never read
        for row, keys in enumerate(rows_keys):
            index[row, : len(keys)] = [encode[k] if k in encode else offset + cached[k] for k in keys]
        feeds[name] = index
    return feeds, encode


def check_single_runtime() -> None:
    """onnxruntime and onnxruntime-gpu install the same module over each other: refuse to run on such a mix."""
    installed = []
    for name in ("onnxruntime", "onnxruntime-gpu"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            installed.append(f"{name} {metadata.version(name)}")
    if len(installed) > 1:
        raise RuntimeError(
            f"both {' and '.join(installed)} are installed; they overwrite each other's files. "
            "Uninstall both, then install one (the `cpu` or the `gpu` extra)."
        )


def choose_providers(provider: str) -> list[str]:
    """Providers for "auto" (CUDA when this onnxruntime has it, else CPU), "cuda" or "cpu"."""
    available = ort.get_available_providers()
    if provider == "auto":
        provider = "cuda" if "CUDAExecutionProvider" in available else "cpu"
    if provider == "cuda":
        if "CUDAExecutionProvider" not in available:
            raise RuntimeError(f"provider 'cuda' asked for, but this onnxruntime only has {available}")
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if provider == "cpu":
        return ["CPUExecutionProvider"]
    raise ValueError(f"provider must be auto, cuda or cpu, not {provider!r}")


def cuda_options(device_id: int, cuda_graphs: bool) -> dict[str, str]:
    """The CUDA provider's options: exact fp32 (the fp16 graph computes its products in fp16 whatever they say)."""
    return {
        "device_id": str(device_id),
        # The provider's default computes fp32 MatMul and Conv in TF32 (10-bit mantissa): 1.8e-3 off the CPU and
        # batch-dependent on an H100 (README, GPU). fp32 means fp32; the fp16 graph has no fp32 products.
        "use_tf32": "0",
        # EXHAUSTIVE (the default) times every algorithm at each new input shape; HEURISTIC asks cuDNN once.
        # The char-CNN's shapes come in buckets (`bucket`), so either way the search is bounded.
        "cudnn_conv_algo_search": "HEURISTIC",
        "enable_cuda_graph": "1" if cuda_graphs else "0",
    }


def bucket(n: int, floor: int = 16, cap: int | None = None) -> int:
    """The next power of two >= n, at least `floor` (and at most `cap`): the window graph is fed a few shapes,
    so that each can be captured as a CUDA graph and ONNX Runtime plans each once."""
    size = max(floor, 1 << max(0, n - 1).bit_length())
    return min(size, cap) if cap is not None else size


PLACED = re.compile(r"(Node\(s\)|All nodes) placed on \[(\w+)\]\. Number of nodes: (\d+)")
NODE = re.compile(r"VerifyEachNodeIsAssignedToAnEp\]\s{3,}(\S+ \(.*\))\s*$")


def nodes_off(report: str, provider: str) -> list[str] | None:
    """The nodes (`OpType (name)`) that ONNX Runtime's verbose session log says it placed on a provider other
    than `provider` (its "Node placements" report); None when the log holds no such report."""
    off, current, seen = [], None, False
    for line in report.splitlines():
        if placed := PLACED.search(line):
            kind, current, count = placed.groups()
            seen = True
            if kind == "All nodes" and current != provider:  # this form lists no nodes, only their number
                off.append(f"all {count} nodes on {current}")
        elif (node := NODE.search(line)) and current != provider:
            off.append(f"{node.group(1)} on {current}")
    return off if seen else None


@contextlib.contextmanager
def _stderr_to(path: Path):
    """Send file descriptor 2 (where ONNX Runtime's C++ logger writes) to a file for the duration."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "wb") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def placed_session(path: Path, options: ort.SessionOptions, providers: list) -> tuple[ort.InferenceSession, str]:
    """A session whose node placements were logged (ONNX Runtime reports them at its verbose level only), and
    that log. File descriptor 2 is the process's: whatever else writes to it meanwhile goes to the log too."""
    level, options.log_severity_level = options.log_severity_level, 0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "ort.log"
            with _stderr_to(report):
                session = ort.InferenceSession(str(path), options, providers=providers)
            return session, report.read_text(errors="replace")
    finally:
        options.log_severity_level = level


def _open(info, cuda: bool, graph: str, precision: str, options, device_id: int, cuda_graphs: bool):
    """The graph to serve and its session (with its placement report on CUDA, else ""). "auto" picks the Loop
    graph on the CPU in fp32 or int8 (measured the faster one there: README, bench/engine.py), else the window
    graph (CUDA, fp16)."""
    if graph == "auto":
        graph = "window" if cuda or precision == "fp16" else "loop"
    chosen = info.graph(graph, precision)
    if not cuda:
        return chosen, ort.InferenceSession(str(chosen.file), options, providers=["CPUExecutionProvider"]), ""
    if hasattr(ort, "preload_dlls"):  # CUDA and cuDNN installed as pip packages (nvidia-*) are found
        ort.preload_dlls()
    capture = cuda_graphs and chosen.kind == "window"  # a graph with a Loop cannot be captured
    providers = [("CUDAExecutionProvider", cuda_options(device_id, capture)), "CPUExecutionProvider"]
    return chosen, *placed_session(chosen.file, options, providers)


@dataclass(frozen=True)
class Graph:
    """One ONNX file of a model folder, as the manifest lists it."""

    file: Path
    kind: str  # "loop": any positions per call, CPU; "window": `window` positions unrolled, static shapes
    precision: str  # "fp32", "int8" (the Loop graph's products in integers, CPU) or "fp16" (window graph)
    window: int | None
    entry: dict


@dataclass(frozen=True)
class ModelInfo:
    manifest: dict
    num_layers: int  # output layers: the token layer and one per LSTM layer
    dim: int  # size of every layer vector
    max_chars: int
    token_dim: int  # size of the char-CNN's token vector (half of dim)
    graphs: tuple[Graph, ...]
    mapping: Mapping  # token -> the row of ints the graph reads (service/mapping.py)

    @property
    def language(self) -> str:
        """Whose Moses rules the service tokenizes text with (service/tokenize.py; an older export: English)."""
        return self.manifest.get("tokenizer", {}).get("language", "en")

    def graph(self, kind: str, precision: str) -> Graph:
        for graph in self.graphs:
            if graph.kind == kind and graph.precision == precision:
                return graph
        have = ", ".join(f"{g.kind} {g.precision}" for g in self.graphs)
        raise ValueError(f"this model folder has no {kind} graph in {precision} (it has: {have}); export it again")


def read_manifest(model_dir: str | Path) -> ModelInfo:
    """The manifest of a folder written by elmo-export; FileNotFoundError or ValueError with a message that
    says what is wrong (no manifest, not JSON, a field missing, no model file), before anything loads."""
    path = Path(model_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {model_dir} a folder written by elmo-export?")
    try:
        manifest = json.loads(path.read_text())
        fields = (
            int(manifest["num_layers"]),
            int(manifest["output_dim"]),
            int(manifest["architecture"]["char_cnn"]["max_characters_per_token"]),
            int(manifest["architecture"]["lstm"]["projection_dim"]),
        )
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise _not_a_manifest(path, err) from None
    if manifest.get("graph_version") not in READABLE_GRAPH_VERSIONS:
        raise ValueError(
            f"{path} holds graph version {manifest.get('graph_version')}, and this engine feeds version "
            f"{GRAPH_VERSION}: export it again with elmo-export"
        )
    try:
        graphs = tuple(Graph(Path(model_dir) / g["file"], g["kind"], g["precision"], g.get("window"), g)
                       for g in manifest["graphs"])  # fmt: skip
    except (KeyError, TypeError) as err:
        raise _not_a_manifest(path, err) from None
    for graph in graphs:
        if not graph.file.is_file():
            raise FileNotFoundError(f"{graph.file} not found: the manifest in {model_dir} names it")
    try:
        mapping = load_mapping(model_dir, manifest)
    except (KeyError, TypeError) as err:
        raise _not_a_manifest(path, err) from None
    return ModelInfo(manifest, *fields, graphs, mapping)


def _not_a_manifest(path: Path, err: Exception) -> ValueError:
    what = f"no {err}" if isinstance(err, KeyError) else f"{type(err).__name__}: {err}"
    return ValueError(f"{path} is not a manifest written by elmo-export ({what})")


class Engine:
    """An ONNX Runtime session on one graph of an exported model, and the state store of the rows in flight.

    `step` runs a window of positions of each row from the state its slot holds (slots 1..max_rows; 0 is a
    scratch slot for the rows that pad a batch to its bucket) and leaves each slot holding the state after
    its window; on CUDA the store never leaves the device. `run` embeds whole sentences with it, in slots
    1..n: never while a Stepper has rows in flight (the batcher's retries run after `Stepper.clear`). One thread
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
        if precision == "int8":
            # The int8 graph is written for ONNX Runtime's CPU kernels (MatMulIntegerToFloat, with per-row scales
            # measured on CPUs only, never on a GPU): "auto" means the CPU for it, and CUDA is refused.
            if provider == "cuda":
                raise RuntimeError(
                    "precision int8 runs on the CPU only (its graph is written for ONNX Runtime's CPU kernels and "
                    "was never measured on a GPU): use provider cpu or auto for int8, or precision fp32 or fp16 on CUDA"
                )
            provider = "cpu"
        names = choose_providers(provider)
        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_threads  # 0: one per core
        options.inter_op_num_threads = inter_op_threads
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # ONNX Runtime keeps a memory pattern for each distinct set of input shapes it has seen, for good; with
        # this graph's shapes (rows, length, distinct and cached tokens) that set keeps growing: an engine fed
        # 10 000 batches of varied shapes grew +13% and was still growing. Off, it levels off, at the same speed.
        options.enable_mem_pattern = False
        cuda = names[0] == "CUDAExecutionProvider"
        opened = _open(self.info, cuda, graph, precision, options, device_id, cuda_graphs)
        if cuda and opened[1].get_providers()[0] != names[0]:
            # ONNX Runtime falls back to the CPU with a warning when CUDA cannot start (no GPU visible, a CUDA
            # or cuDNN library missing): a GPU deployment would look healthy at a fraction of its speed.
            if provider == "cuda":
                raise RuntimeError(
                    f"provider 'cuda' asked for, but ONNX Runtime could not start {names[0]} and fell back to "
                    f"{opened[1].get_providers()[0]}: is a GPU visible, and are the CUDA and cuDNN libraries "
                    f"onnxruntime-gpu {ort.__version__} needs installed?"
                )
            log.warning("no usable GPU (ONNX Runtime fell back to the CPU): serving the CPU's graph on the CPU")
            cuda = False
            opened = _open(self.info, cuda, graph, precision, options, device_id, cuda_graphs)
        self.graph, self.session, placement = opened
        self.provider = self.session.get_providers()[0]
        self.window = self.graph.window  # positions per call of the window graph; None: any
        if cuda:
            off = nodes_off(placement, names[0])
            if off is None:
                log.warning("ONNX Runtime's placement report was not found in its log: node placement unchecked")
            elif off and self.graph.kind == "loop":
                # ONNX Runtime keeps small int64 shape computations of a Loop on the CPU by design (the Loop is
                # driven from the host anyway): the window graph is the one written to run wholly on the GPU.
                log.warning(
                    "provider 'cuda', the Loop graph: ONNX Runtime placed %d node(s) of %s off the GPU (as it does "
                    "for a Loop's shape computations): %s",
                    len(off),
                    self.graph.file.name,
                    ", ".join(off[:10]),
                )
            elif off:  # a node on the CPU means copies to and from the host at every call (and no CUDA graph)
                raise RuntimeError(
                    f"provider 'cuda': ONNX Runtime placed {len(off)} node(s) of {self.graph.file.name} off the "
                    "GPU: " + ", ".join(off[:10])
                )
        # The state each window continues from, h and c per layer and direction: name -> width.
        self.state_sizes = {i.name: i.shape[1] for i in self.session.get_inputs() if i.name[:2] in ("h_", "c_")}
        self._outputs = [output.name for output in self.session.get_outputs()]
        self.device = "cuda" if cuda else "cpu"
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


def place(layers: list[np.ndarray], windows: Sequence[Window], fwd: np.ndarray, bwd: np.ndarray, half: int) -> None:
    """Write a step's packed outputs into each row's layers (L+1, T, 2P) (T counts <S> and </S>): the forward
    half at the window's positions, the backward half at the positions it read, the sentence reversed."""
    q = 0
    for row, (keys, first, n) in zip(layers, windows, strict=True):
        row[:, first : first + n, :half] = fwd[:, q : q + n]
        end = len(keys) - first
        row[:, end - n : end, half:] = bwd[:, q : q + n][:, ::-1]
        q += n
