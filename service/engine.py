"""The ONNX Runtime engine: token lists in, each sentence's layers out. Owns the session and nothing else.

The exported graph takes the batch as unique tokens + indices into them, and runs a window of positions of
each sentence from a given state (see model_export/onnx_graph.py): `run` is one window covering each whole
sentence, `run_windows` any windows (service/stepper.py). The char-CNN runs once per distinct token of a
call, and not at all for tokens whose vectors the engine kept from earlier calls (`TokenCache`: exactly the
bits it would compute again). Each sentence is wrapped in <S> ... </S>, the way the biLM was trained, and
the boundary positions are cut off again before the vectors are returned.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
import onnxruntime as ort

from service.chars import BOS_TOKEN, EOS_TOKEN, char_key, key_char_ids

MANIFEST = "manifest.json"
# The graph this engine feeds (model_export/onnx_graph.py writes it): bumped whenever the graph changes (inputs,
# outputs or what it computes fast); an export of another version is refused.
GRAPH_VERSION = 5


class TokenCache:
    """Token vectors (the char-CNN's output) of recently seen tokens, at most `size`, least recent out first.

    A token's vector depends on its char ids alone (see `char_key`, the cache's key: at most 48 bytes however
    long the token), and the graph computes it with the same bits in any batch, so a cached vector equals a
    recomputed one exactly: the cache saves the char-CNN's share of the work (about a quarter of the model)
    for frequent words and changes no output."""

    def __init__(self, size: int):
        self.size = size
        self._vectors: OrderedDict[str | bytes, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._vectors)

    def get(self, key: str | bytes) -> np.ndarray | None:
        with self._lock:
            vector = self._vectors.get(key)
            if vector is not None:
                self._vectors.move_to_end(key)
            return vector

    def put(self, key: str | bytes, vector: np.ndarray) -> None:
        if self.size <= 0:
            return
        with self._lock:
            self._vectors[key] = vector
            self._vectors.move_to_end(key)
            while len(self._vectors) > self.size:
                self._vectors.popitem(last=False)


def sentence_keys(sentence: Sequence[str], max_chars: int) -> list[str | bytes]:
    """The sentence as the biLM reads it: <S>, each token's `char_key`, </S>."""
    return [BOS_TOKEN, *(char_key(token, max_chars) for token in sentence), EOS_TOKEN]


Window = tuple[Sequence[str | bytes], int, int]  # a sentence's keys (`sentence_keys`), first position, positions


def encode_windows(
    windows: Sequence[Window], max_chars: int, dim: int, cache: TokenCache | None = None
) -> tuple[dict[str, np.ndarray], dict[str | bytes, int]]:
    """The graph's token inputs for a window of positions of each sentence, and what it will encode
    (`char_key` -> row of `token_vectors`).

    The backward direction reads positions first..first+n-1 of the sentence reversed. Each distinct key
    appears once (tokens that differ only past the kept bytes share one): encoded from its chars
    (`token_chars`), or taken from the cache (`cached_vectors`); at least one row is encoded."""
    forward = [keys[first : first + n] for keys, first, n in windows]
    backward = [keys[len(keys) - first - n : len(keys) - first][::-1] for keys, first, n in windows]
    encode: dict[str | bytes, int] = {}
    cached: dict[str | bytes, int] = {}
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
        encode[BOS_TOKEN] = 0
    offset = len(encode)  # the indices count the encoded rows first, then the cached ones

    steps = max(n for _, _, n in windows)
    feeds = {
        "token_chars": np.stack([key_char_ids(key, max_chars) for key in encode]),
        "cached_vectors": np.stack(cached_vectors) if cached_vectors else np.zeros((0, dim), np.float32),
        "lengths": np.array([n for _, _, n in windows], dtype=np.int64),
    }
    for name, rows in (("index_fwd", forward), ("index_bwd", backward)):
        index = np.zeros((len(windows), steps), dtype=np.int64)  # padding points at row 0: never read
        for row, keys in enumerate(rows):
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


@dataclass(frozen=True)
class ModelInfo:
    manifest: dict
    num_layers: int  # output layers: the token layer and one per LSTM layer
    dim: int  # size of every layer vector
    max_chars: int
    token_dim: int  # size of the char-CNN's token vector (half of dim)
    model_file: Path


def read_manifest(model_dir: str | Path) -> ModelInfo:
    """The manifest of a folder written by elmo-export; FileNotFoundError or ValueError with a message that
    says what is wrong (no manifest, not JSON, a field missing, no model file), before anything loads."""
    path = Path(model_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {model_dir} a folder written by elmo-export?")
    try:
        manifest = json.loads(path.read_text())
        info = ModelInfo(
            manifest=manifest,
            num_layers=int(manifest["num_layers"]),
            dim=int(manifest["output_dim"]),
            max_chars=int(manifest["architecture"]["char_cnn"]["max_characters_per_token"]),
            token_dim=int(manifest["architecture"]["lstm"]["projection_dim"]),
            model_file=Path(model_dir) / manifest.get("model_file", "model.onnx"),
        )
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        what = f"no {err}" if isinstance(err, KeyError) else f"{type(err).__name__}: {err}"
        raise ValueError(f"{path} is not a manifest written by elmo-export ({what})") from None
    if manifest.get("graph_version") != GRAPH_VERSION:
        raise ValueError(
            f"{path} holds graph version {manifest.get('graph_version')}, and this engine feeds version "
            f"{GRAPH_VERSION}: export it again with elmo-export"
        )
    if not info.model_file.is_file():
        raise FileNotFoundError(f"{info.model_file} not found: the manifest in {model_dir} names it")
    return info


class Engine:
    """An ONNX Runtime session on an exported model. Thread-safe: ONNX Runtime allows concurrent `run`s."""

    def __init__(
        self,
        model_dir: str | Path,
        provider: str = "auto",
        intra_op_threads: int = 0,
        inter_op_threads: int = 0,
        token_cache: int = 50_000,
    ):
        check_single_runtime()
        self.info = read_manifest(model_dir)
        self.token_cache = TokenCache(token_cache)
        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_threads  # 0: one per core
        options.inter_op_num_threads = inter_op_threads
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # ONNX Runtime keeps a memory pattern for each distinct set of input shapes it has seen, for good; with
        # this graph's shapes (rows, length, distinct and cached tokens) that set keeps growing: an engine fed
        # 10 000 batches of varied shapes grew +13% and was still growing. Off, it levels off, at the same speed.
        options.enable_mem_pattern = False
        providers = choose_providers(provider)
        self.session = ort.InferenceSession(str(self.info.model_file), options, providers=providers)
        self.provider = self.session.get_providers()[0]
        # The state each window continues from, h and c per layer and direction: name -> width.
        self.state_sizes = {i.name: i.shape[1] for i in self.session.get_inputs() if i.name[:2] in ("h_", "c_")}
        self._outputs = [output.name for output in self.session.get_outputs()]
        if provider == "cuda" and self.provider != providers[0]:
            # ONNX Runtime falls back to the CPU with a warning when CUDA cannot start (no GPU visible, a CUDA
            # or cuDNN library missing): a GPU deployment would look healthy at a fraction of its speed.
            raise RuntimeError(
                f"provider 'cuda' asked for, but ONNX Runtime could not start {providers[0]} and fell back to "
                f"{self.provider}: is a GPU visible, and are the CUDA and cuDNN libraries onnxruntime-gpu "
                f"{ort.__version__} needs installed?"
            )

    @property
    def num_layers(self) -> int:
        return self.info.num_layers

    @property
    def dim(self) -> int:
        return self.info.dim

    def run(self, sentences: Sequence[Sequence[str]]) -> list[np.ndarray]:
        """Each sentence's layers, (num_layers, n_tokens, dim) float32, boundary tokens removed."""
        if not sentences:
            return []
        keys = [sentence_keys(s, self.info.max_chars) for s in sentences]
        out = self.run_windows([(k, 0, len(k)) for k in keys], np.ones(len(keys), bool), None)
        fwd, bwd = out["layers_fwd"], out["layers_bwd"]  # (num_layers, B, T, P), bwd in reversed order
        results = []
        for row, sentence in enumerate(sentences):
            n = len(sentence)
            layers = np.empty((self.num_layers, n, self.dim), np.float32)
            layers[..., : self.info.token_dim] = fwd[:, row, 1 : n + 1]
            layers[..., self.info.token_dim :] = bwd[:, row, n:0:-1]  # reversed position q is position T-1-q
            results.append(layers)
        return results

    def run_windows(
        self, windows: Sequence[Window], start: np.ndarray, states: dict[str, np.ndarray] | None
    ) -> dict[str, np.ndarray]:
        """Run a window of positions of each sentence (see model_export/onnx_graph.py): from the initial
        state where `start`, else from `states` (each `state_sizes` entry, one row per window; None: all
        start). Returns every output by name; the char-CNN's new token vectors go to the cache."""
        feeds, encoded = encode_windows(windows, self.info.max_chars, self.info.token_dim, self.token_cache)
        feeds["start"] = start
        for name, size in self.state_sizes.items():
            feeds[name] = states[name] if states is not None else np.zeros((len(windows), size), np.float32)
        out = dict(zip(self._outputs, self.session.run(self._outputs, feeds), strict=True))
        for key, row in encoded.items():
            if key not in (BOS_TOKEN, EOS_TOKEN):  # never looked up in the cache
                self.token_cache.put(key, out["token_vectors"][row].copy())
        return out
