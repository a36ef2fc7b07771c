"""elmo-export: a published `options.json` + `weights.hdf5` -> `model.onnx` + `manifest.json`.

The export is only written when ONNX Runtime, fed exactly as the service's engine feeds it, equals the
PyTorch biLM on a check batch (max abs error <= 1e-5); otherwise it fails loudly.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from model_export.bilm import BiLM
from model_export.initial_state import mean_final_state
from model_export.onnx_graph import GRAPH_VERSION, OPSET, build_onnx_model
from model_export.weights import load_bilm
from service.chars import sentence_char_ids
from service.engine import MANIFEST, Engine

TOLERANCE = 1e-5
MODEL_FILE = "model.onnx"
EXTERNAL_DATA_BYTES = 1 << 30  # protobuf stops at 2 GiB: larger weights go to model.onnx.data

# Lengths 1 to 60, repeated and unseen words, non-ASCII, an empty and an over-long token.
CHECK_SENTENCES = [
    ["Hello"],
    ["Two", "words"],
    ["The", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "."],
    ["Ünïcödé", "naïve", "café", "日本語", "🙂", "", "x" * 70, "<S>", "</S>"],
    ("the cat sat on the mat because the mat was warm and the cat was cold " * 4).split(),
]


class ExportError(RuntimeError):
    pass


def sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def torch_layers(model: BiLM, sentences: list[list[str]]) -> list[np.ndarray]:
    """The reference: each sentence's layers from the PyTorch biLM, boundary tokens removed."""
    max_chars = model.options.max_chars
    chars = np.zeros((len(sentences), max(len(s) for s in sentences) + 2, max_chars), dtype=np.int64)
    for row, sentence in enumerate(sentences):
        chars[row, : len(sentence) + 2] = sentence_char_ids(sentence, max_chars)
    with torch.no_grad():
        layers = model(torch.from_numpy(chars)).numpy()
    return [layers[:, row, 1 : len(s) + 1] for row, s in enumerate(sentences)]


def max_abs_error(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max(initial=0.0)) for x, y in zip(a, b, strict=True))


def save_onnx(model_proto: onnx.ModelProto, path: Path) -> None:
    if model_proto.ByteSize() < EXTERNAL_DATA_BYTES:
        onnx.save_model(model_proto, path)
    else:
        onnx.save_model(model_proto, path, save_as_external_data=True, location=path.name + ".data")


def export_model(model: BiLM, out_dir: str | Path, sources: dict[str, Path] | None = None) -> dict:
    """Write `model` to out_dir as model.onnx + manifest.json after the parity check; returns the manifest."""
    out_dir = Path(out_dir)
    opt = model.options
    cells = [*model.forward_lstm.layers, *model.backward_lstm.layers]
    initial_state = "warm" if any(bool(c.h0.any() or c.c0.any()) for c in cells) else "zero"
    with tempfile.TemporaryDirectory(dir=out_dir.parent if out_dir.parent.exists() else None) as tmp:
        tmp = Path(tmp)
        model_proto = build_onnx_model(model)
        onnx.checker.check_model(model_proto, full_check=model_proto.ByteSize() < EXTERNAL_DATA_BYTES)
        save_onnx(model_proto, tmp / MODEL_FILE)
        del model_proto
        manifest = {
            "format_version": 1,
            "model_file": MODEL_FILE,
            "architecture": opt.to_dict(),
            "num_layers": opt.num_output_layers,
            "output_dim": opt.output_dim,
            "initial_state": initial_state,
            "sources": {kind: {"file": Path(p).name, "sha256": sha256(p)} for kind, p in (sources or {}).items()},
            "graph_version": GRAPH_VERSION,
            "opset": OPSET,
            "onnx_version": onnx.__version__,
            "onnxruntime_version": ort.__version__,
            "torch_version": torch.__version__,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        engine = Engine(tmp, provider="cpu")
        error = max_abs_error(engine.run(CHECK_SENTENCES), torch_layers(model, CHECK_SENTENCES))
        del engine
        if not error <= TOLERANCE:
            raise ExportError(f"ONNX Runtime differs from PyTorch by {error:.3g} > {TOLERANCE} on the check batch")
        manifest["parity"] = {
            "max_abs_error": error,
            "tolerance": TOLERANCE,
            "check_sentences": len(CHECK_SENTENCES),
            "check_tokens": sum(len(s) for s in CHECK_SENTENCES),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        out_dir.mkdir(parents=True, exist_ok=True)
        for stale in out_dir.glob(MODEL_FILE + "*"):
            stale.unlink()
        for item in tmp.iterdir():
            shutil.move(str(item), out_dir / item.name)
    return manifest


def export_published(
    options_path: str | Path, weights_path: str | Path, out_dir: str | Path, warmup_text: str | Path | None = None
) -> dict:
    """Export a published-layout model; with `warmup_text` (tokenized, one sentence per line) every sentence
    starts from the warm state computed on it (model_export.initial_state), else from zero."""
    model = load_bilm(options_path, weights_path)
    sources = {"options": Path(options_path), "weights": Path(weights_path)}
    if warmup_text is None:
        return export_model(model, out_dir, sources)
    sentences = [line.split() for line in Path(warmup_text).read_text(encoding="utf-8").splitlines() if line.strip()]
    model.set_initial_state(mean_final_state(model, sentences))
    return export_model(model, out_dir, sources | {"warmup_text": Path(warmup_text)})
