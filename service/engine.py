"""The ONNX Runtime engine: token lists in, each sentence's layers out. Owns the session and nothing else.

The exported graph takes the batch as unique tokens + an index (see model_export/onnx_graph.py), so the
char-CNN runs once per distinct token of a batch. Each sentence is wrapped in <S> ... </S>, the way the
biLM was trained, and the boundary positions are cut off again before the vectors are returned.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from service.chars import BOS_TOKEN, EOS_TOKEN, token_char_ids

MANIFEST = "manifest.json"


def encode_batch(sentences: Sequence[Sequence[str]], max_chars: int) -> dict[str, np.ndarray]:
    """The graph's inputs for a batch: unique tokens' char ids, each position's token, each row's length."""
    steps = max(len(s) for s in sentences) + 2
    token_index = np.zeros((len(sentences), steps), dtype=np.int64)  # padding points at <S>: never read
    lengths = np.empty(len(sentences), dtype=np.int64)
    ids: dict[str, int] = {BOS_TOKEN: 0, EOS_TOKEN: 1}
    for row, sentence in enumerate(sentences):
        positions = [ids.setdefault(token, len(ids)) for token in sentence]
        token_index[row, 1 : len(sentence) + 1] = positions
        token_index[row, len(sentence) + 1] = 1
        lengths[row] = len(sentence) + 2
    token_chars = np.stack([token_char_ids(token, max_chars) for token in ids])
    return {"token_chars": token_chars, "token_index": token_index, "lengths": lengths}


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


def read_manifest(model_dir: str | Path) -> ModelInfo:
    path = Path(model_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {model_dir} a folder written by elmo-export?")
    manifest = json.loads(path.read_text())
    return ModelInfo(
        manifest=manifest,
        num_layers=int(manifest["num_layers"]),
        dim=int(manifest["output_dim"]),
        max_chars=int(manifest["architecture"]["char_cnn"]["max_characters_per_token"]),
    )


class Engine:
    """An ONNX Runtime session on an exported model. Thread-safe: ONNX Runtime allows concurrent `run`s."""

    def __init__(
        self, model_dir: str | Path, provider: str = "auto", intra_op_threads: int = 0, inter_op_threads: int = 0
    ):
        self.info = read_manifest(model_dir)
        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_threads  # 0: one per core
        options.inter_op_num_threads = inter_op_threads
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        model_file = Path(model_dir) / self.info.manifest.get("model_file", "model.onnx")
        self.session = ort.InferenceSession(str(model_file), options, providers=choose_providers(provider))
        self.provider = self.session.get_providers()[0]

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
        feeds = encode_batch(sentences, self.info.max_chars)
        (layers,) = self.session.run(["layers"], feeds)  # (num_layers, B, T, dim)
        return [np.ascontiguousarray(layers[:, row, 1 : len(s) + 1]) for row, s in enumerate(sentences)]
