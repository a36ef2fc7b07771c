"""elmo-export: a published `options.json` + `weights.hdf5` -> `model.onnx` + `manifest.json`.

The export is only written when ONNX Runtime, fed exactly as the service's engine feeds it, equals the
PyTorch biLM on a check batch (max abs error <= 1e-5); otherwise it fails loudly.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from model_export.bilm import BiLM
from model_export.initial_state import mean_final_state
from model_export.manylangs import copy_mapping, load_manylangs
from model_export.onnx_graph import GRAPH_VERSION, OPSET, build_onnx_model, build_window_model
from model_export.weights import load_bilm
from service.engine import MANIFEST, Engine, sentence_keys
from service.mapping import BILM_TF, BilmTfMapping, load_mapping

TOLERANCE = 1e-5
MODEL_FILE = "model.onnx"  # the Loop graph: the CPU's (measured faster there than the window graph)
# The window graph for CUDA: positions unrolled per call (the engine feeds longer sentences window after window).
WINDOW = 32
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


def torch_layers(model: BiLM, sentences: list[list[str]], mapping=None) -> list[np.ndarray]:
    """The reference: each sentence's layers from the PyTorch biLM (on whichever device it is), boundary tokens
    removed; tokens mapped to ids by `mapping` (service/mapping.py; default: the published byte mapping)."""
    mapping = mapping or BilmTfMapping(model.options.max_chars)
    chars = np.zeros((len(sentences), max(len(s) for s in sentences) + 2, mapping.width), dtype=np.int64)
    for row, sentence in enumerate(sentences):
        chars[row, : len(sentence) + 2] = [mapping.row(key) for key in sentence_keys(sentence, mapping)]
    lengths = torch.tensor([len(s) + 2 for s in sentences])
    device = next(model.parameters()).device
    with torch.no_grad():
        layers = model(torch.from_numpy(chars).to(device), lengths.to(device)).cpu().numpy()
    return [layers[:, row, 1 : len(s) + 1] for row, s in enumerate(sentences)]


def max_abs_error(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max(initial=0.0)) for x, y in zip(a, b, strict=True))


def save_onnx(model_proto: onnx.ModelProto, path: Path) -> None:
    if model_proto.ByteSize() < EXTERNAL_DATA_BYTES:
        onnx.save_model(model_proto, path)
    else:
        onnx.save_model(model_proto, path, save_as_external_data=True, location=path.name + ".data")


def cosine_min(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """The smallest cosine between corresponding vectors (every layer, every token) of two results."""
    x, y = (np.concatenate([layers.reshape(-1, layers.shape[-1]) for layers in r]).astype(np.float64) for r in (a, b))
    norms = np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1)
    return float(np.min((x * y).sum(axis=1) / np.maximum(norms, 1e-30)))


def export_model(
    model: BiLM,
    out_dir: str | Path,
    sources: dict[str, Path] | None = None,
    window: int = WINDOW,
    write_mapping: Callable[[Path], dict] | None = None,
    language: str = "en",
) -> dict:
    """Write `model` to out_dir after the parity check, returns the manifest: model.onnx (the Loop graph, the
    CPU's), model_window.onnx (the window graph, `window` positions unrolled, for CUDA) and model_window_fp16.onnx
    (the same in reduced precision, opt-in). The two fp32 graphs must equal PyTorch within TOLERANCE on the CPU;
    the fp16 graph's distance from fp32 is measured and recorded. `write_mapping(folder)` writes the files of a
    token mapping other than the published one there, and returns the manifest's `token_mapping`; `language`:
    whose Moses rules the service tokenizes text with."""
    out_dir = Path(out_dir)
    opt = model.options
    cells = [*model.forward_lstm.layers, *model.backward_lstm.layers]
    initial_state = "warm" if any(bool(c.h0.any() or c.c0.any()) for c in cells) else "zero"
    graphs = [
        {"file": MODEL_FILE, "kind": "loop", "precision": "fp32", "window": None, "for": "CPU"},
        {"file": "model_window.onnx", "kind": "window", "precision": "fp32", "window": window, "for": "CUDA"},
        {"file": "model_window_fp16.onnx", "kind": "window", "precision": "fp16", "window": window,
         "for": "CUDA with precision fp16 (opt-in)"},
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(dir=out_dir.parent if out_dir.parent.exists() else None) as tmp:
        tmp = Path(tmp)
        for graph in graphs:
            if graph["kind"] == "loop":
                model_proto = build_onnx_model(model)
            else:
                model_proto = build_window_model(model, window, graph["precision"])
            onnx.checker.check_model(model_proto, full_check=model_proto.ByteSize() < EXTERNAL_DATA_BYTES)
            save_onnx(model_proto, tmp / graph["file"])
            del model_proto
        manifest = {
            "format_version": 2,
            "graphs": graphs,
            "architecture": opt.to_dict(),
            "num_layers": opt.num_output_layers,
            "output_dim": opt.output_dim,
            "initial_state": initial_state,
            "token_mapping": write_mapping(tmp) if write_mapping else {"family": BILM_TF},
            "tokenizer": {"name": "moses", "language": language},
            "sources": {kind: {"file": Path(p).name, "sha256": sha256(p)} for kind, p in (sources or {}).items()},
            "graph_version": GRAPH_VERSION,
            "opset": OPSET,
            "onnx_version": onnx.__version__,
            "onnxruntime_version": ort.__version__,
            "torch_version": torch.__version__,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        want = torch_layers(model, CHECK_SENTENCES, load_mapping(tmp, manifest))
        fp32 = None
        for graph in graphs:
            engine = Engine(tmp, provider="cpu", graph=graph["kind"], precision=graph["precision"])
            got = engine.run(CHECK_SENTENCES)
            del engine
            error = max_abs_error(got, want)
            if graph["precision"] == "fp32":
                if not error <= TOLERANCE:
                    raise ExportError(
                        f"ONNX Runtime ({graph['kind']} graph) differs from PyTorch by {error:.3g} > {TOLERANCE} "
                        "on the check batch"
                    )
                graph["parity"] = {"max_abs_error": error, "tolerance": TOLERANCE}
                fp32 = fp32 or got
            else:  # measured on the CPU's fp16 products at export; bench/gpu.py measures it on the GPU
                graph["accuracy"] = {
                    "max_abs_error_vs_fp32": max_abs_error(got, fp32),
                    "min_cosine_vs_fp32": cosine_min(got, fp32),
                }
        manifest["parity"] = {
            "max_abs_error": max(g["parity"]["max_abs_error"] for g in graphs if "parity" in g),
            "tolerance": TOLERANCE,
            "check_sentences": len(CHECK_SENTENCES),
            "check_tokens": sum(len(s) for s in CHECK_SENTENCES),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        out_dir.mkdir(parents=True, exist_ok=True)
        for stale in [*out_dir.glob("model*.onnx*"), *out_dir.glob("*.dic")]:  # also an earlier export's mapping
            stale.unlink()
        for item in tmp.iterdir():
            shutil.move(str(item), out_dir / item.name)
    return manifest


def export_published(
    options_path: str | Path,
    weights_path: str | Path,
    out_dir: str | Path,
    warmup_text: str | Path | None = None,
    window: int = WINDOW,
    language: str = "en",
) -> dict:
    """Export a published-layout model; with `warmup_text` (tokenized, one sentence per line) every sentence
    starts from the warm state computed on it (model_export.initial_state), else from zero."""
    model = load_bilm(options_path, weights_path)
    sources = {"options": Path(options_path), "weights": Path(weights_path)}
    if warmup_text is None:
        return export_model(model, out_dir, sources, window, language=language)
    sentences = [line.split() for line in Path(warmup_text).read_text(encoding="utf-8").splitlines() if line.strip()]
    model.set_initial_state(mean_final_state(model, sentences))
    return export_model(model, out_dir, sources | {"warmup_text": Path(warmup_text)}, window, language=language)


def export_manylangs(folder: str | Path, out_dir: str | Path, window: int = WINDOW, language: str = "en") -> dict:
    """Export an ELMoForManyLangs model folder (model_export/manylangs.py): its biLM, and its char.dic and word.dic
    next to the graphs, from which the service maps tokens as that model was trained."""
    folder = Path(folder)
    model = load_manylangs(folder)
    files = ("config.json", "token_embedder.pkl", "encoder.pkl", "char.dic", "word.dic")
    sources = {name: folder / name for name in files if (folder / name).is_file()}
    has_words = model.token_encoder.word_embed is not None
    return export_model(model, out_dir, sources, window, lambda out: copy_mapping(folder, out, has_words), language)
