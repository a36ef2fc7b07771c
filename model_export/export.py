"""elmo-export: a published `options.json` + `weights.hdf5` -> `model.onnx` + `manifest.json`.

The export is only written when ONNX Runtime, fed exactly as the service's engine feeds it, equals the
PyTorch biLM on a check batch (max abs error <= 1e-5); otherwise it fails loudly. The reduced-precision graphs'
distance from fp32 is measured on the same batch and recorded, and the check sentences stay in the folder as
canaries with the fp32 Loop graph's layers for them, which every engine compares itself with at start-up
(service/engine/canary.py).
"""

from __future__ import annotations

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
from model_export.onnx_graph import OPSET, Int8, build_onnx_model, build_window_model, u8_twin
from model_export.weights import load_bilm
from service.engine.canary import CANARIES_FILE, accuracy, max_abs_error, save_canaries
from service.engine.feeds import sentence_keys
from service.engine.session import Engine
from service.manifest import FORMAT_VERSION, GRAPH_VERSION, MANIFEST, sha256
from service.text.token_ids import BILM_TF, BilmTfMapping, load_mapping

TOLERANCE = 1e-5
MODEL_FILE = "model.onnx"  # the Loop graph: the CPU's (measured faster there than the window graph)
# The window graph for CUDA: positions unrolled per call (the engine feeds longer sentences window after window).
WINDOW = 32
EXTERNAL_DATA_BYTES = 1 << 30  # protobuf stops at 2 GiB: larger weights go to model.onnx.data
# The int8 graph's scheme (README, "int8 on the CPU": the measured choices): weights per column, activations per
# row in 7 bits (exact integer products on every x86 CPU, no int16 saturation without VNNI).
INT8 = Int8(activations="row7", weights="s8", token_encoder=True)
# Its goal (issue 22): every token vector of every layer above 0 within cosine 0.999 of fp32 on the check
# sentences. A model whose token encoder has outlying activations misses it with INT8 (the default model trained
# on 13 sources: 0.9967 in layer 2, as a 7-bit row rounds the rest of an outlier's row coarsely and the LSTMs carry
# the error on); its export keeps the token encoder's products in fp32 instead (0.9998 there), a sixth of a
# full-size token's FLOPs. The manifest says which scheme each export took.
INT8_GOAL = 0.999
INT8_FALLBACK = Int8(activations="row7", weights="s8", token_encoder=False)
# The int8 graph for CPUs whose integer products take 8-bit activations times s8 weights without saturating (VNNI's
# VPDPBUSD, AMX's tiles; AVX2's VPMADDUBSW saturates at int16): the engine serves it where the CPU has one of
# INT8_VNNI_FLAGS (/proc/cpuinfo's names), else the graph above (service/engine/providers.py). 8 bits buy the
# accuracy to spend on fewer passes around the products (docs/performance.md, "The time around the products"):
# the cell output at its bound and the char convolutions as integer products. Not `fused` (each step's input and
# state in one product): that reads [w_input; w_hidden] at every step, and one sentence at a time, bound by the
# weights it reads, ran at 0.78x main's int8 (docs/performance.md). Its accuracy is measured on its u8 x u8 twin
# (`u8_twin`: the same integers on any CPU), held to INT8_GOAL as the other's, with INT8_VNNI_FALLBACK (the token
# encoder in fp32) where it misses.
INT8_VNNI = Int8(activations="row8", weights="s8", token_encoder=True, bounded=True, convolutions=True)
INT8_VNNI_FALLBACK = Int8(activations="row8", weights="s8", token_encoder=False, bounded=True)
INT8_VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
INT8_VNNI_FILE = "model_int8_vnni.onnx"

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


def torch_layers(model: BiLM, sentences: list[list[str]], mapping=None) -> list[np.ndarray]:
    """The reference: each sentence's layers from the PyTorch biLM (on whichever device it is), boundary tokens
    removed; tokens mapped to ids by `mapping` (service/text/token_ids.py; default: the published byte mapping)."""
    mapping = mapping or BilmTfMapping(model.options.max_chars)
    chars = np.zeros((len(sentences), max(len(s) for s in sentences) + 2, mapping.width), dtype=np.int64)
    for row, sentence in enumerate(sentences):
        chars[row, : len(sentence) + 2] = [mapping.row(key) for key in sentence_keys(sentence, mapping)]
    lengths = torch.tensor([len(s) + 2 for s in sentences])
    device = next(model.parameters()).device
    with torch.no_grad():
        layers = model(torch.from_numpy(chars).to(device), lengths.to(device)).cpu().numpy()
    return [layers[:, row, 1 : len(s) + 1] for row, s in enumerate(sentences)]


def save_onnx(model_proto: onnx.ModelProto, path: Path) -> None:
    if model_proto.ByteSize() < EXTERNAL_DATA_BYTES:
        onnx.save_model(model_proto, path)
    else:
        onnx.save_model(model_proto, path, save_as_external_data=True, location=path.name + ".data")


def graph_list(window: int = WINDOW, int8: Int8 = INT8, int8_vnni: Int8 = INT8_VNNI) -> list[dict]:
    """The graphs an export writes, as its manifest lists them (before their measured errors are added). The VNNI
    int8 graph comes last, after the one every CPU computes exactly: an engine that does not read `cpu_flags`
    takes the first graph of a kind and precision."""
    return [
        {"file": MODEL_FILE, "kind": "loop", "precision": "fp32", "window": None, "for": "CPU"},
        {"file": "model_int8.onnx", "kind": "loop", "precision": "int8", "window": None,
         "for": "CPU with precision int8 (opt-in)", "quantization": int8.to_dict()},
        {"file": "model_window.onnx", "kind": "window", "precision": "fp32", "window": window, "for": "CUDA"},
        {"file": "model_window_fp16.onnx", "kind": "window", "precision": "fp16", "window": window,
         "for": "CUDA with precision fp16 (opt-in)"},
        {"file": INT8_VNNI_FILE, "kind": "loop", "precision": "int8", "window": None,
         "for": "CPU with VNNI or AMX, precision int8 (opt-in)", "quantization": int8_vnni.to_dict(),
         "cpu_flags": list(INT8_VNNI_FLAGS)},
    ]  # fmt: skip


def export_model(
    model: BiLM,
    out_dir: str | Path,
    sources: dict[str, Path] | None = None,
    window: int = WINDOW,
    write_mapping: Callable[[Path], dict] | None = None,
    language: str = "en",
    int8: Int8 = INT8,
) -> dict:
    """Write `model` to out_dir after the parity check, returns the manifest: model.onnx (the Loop graph, the
    CPU's), model_int8.onnx (the same with its products in int8 as `int8` says, for the CPU, opt-in),
    model_window.onnx (the window graph, `window` positions unrolled, for CUDA) and model_window_fp16.onnx (the
    same in reduced precision, opt-in), and canaries.npz (the check sentences' layers from model.onnx). The two
    fp32 graphs must equal PyTorch within TOLERANCE on the CPU; the reduced-precision graphs' distance from fp32
    is measured and recorded. `write_mapping(folder)` writes the files of a token mapping other than the
    published one there, and returns the manifest's `token_mapping`; `language`: whose Moses rules the service
    tokenizes text with."""
    out_dir = Path(out_dir)
    graphs = graph_list(window, int8)
    with tempfile.TemporaryDirectory(dir=out_dir.parent if out_dir.parent.exists() else None) as tmp:
        tmp = Path(tmp)
        _write_graphs(model, graphs, tmp, window, twins=True)  # the VNNI graph's u8 twin, to measure
        manifest = _manifest(model, graphs, tmp, sources, write_mapping, language)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        mapping = load_mapping(tmp, manifest)
        check = check_sentences(mapping)
        fp32 = _check_graphs(graphs, tmp, torch_layers(model, check, mapping), check)
        for graph in graphs:
            if graph["precision"] == "int8":
                _int8_within_goal(model, graph, tmp, fp32, check)
        _write_graphs(model, [g for g in graphs if "cpu_flags" in g], tmp, window)  # the graphs served
        manifest["parity"] = {
            "max_abs_error": max(g["parity"]["max_abs_error"] for g in graphs if "parity" in g),
            "tolerance": TOLERANCE,
            "check_sentences": len(check),
            "check_tokens": sum(len(s) for s in check),
        }
        # The check sentences are the canaries: a reduced-precision graph's stated accuracy is measured on them.
        save_canaries(tmp / CANARIES_FILE, check, fp32)
        manifest["canaries"] = {"file": CANARIES_FILE, "graph": MODEL_FILE, "sentences": check}
        # Every file's sum, which start-up checks (service/manifest.py, verify_files): a graph changed after
        # export is refused before it serves, whatever its canaries say.
        manifest["files"] = {p.name: sha256(p) for p in sorted(tmp.iterdir()) if p.name != MANIFEST}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        _replace_export(tmp, out_dir)
    return manifest


def _write_graphs(model: BiLM, graphs: list[dict], folder: Path, window: int, twins: bool = False) -> None:
    """Each graph of `graphs` into `folder`; `twins`: a graph for certain CPUs (`cpu_flags`) as its `u8_twin`."""
    for graph in graphs:
        if graph["kind"] == "loop":
            scheme = Int8(**graph["quantization"]) if graph["precision"] == "int8" else None
            model_proto = build_onnx_model(model, graph["precision"], scheme)
        else:
            model_proto = build_window_model(model, window, graph["precision"])
        onnx.checker.check_model(model_proto, full_check=model_proto.ByteSize() < EXTERNAL_DATA_BYTES)
        save_onnx(u8_twin(model_proto) if twins and "cpu_flags" in graph else model_proto, folder / graph["file"])
        del model_proto


def _manifest(model: BiLM, graphs: list[dict], folder: Path, sources, write_mapping, language: str) -> dict:
    opt = model.options
    cells = [*model.forward_lstm.layers, *model.backward_lstm.layers]
    return {
        "format_version": FORMAT_VERSION,
        "graphs": graphs,
        "architecture": opt.to_dict(),
        "num_layers": opt.num_output_layers,
        "output_dim": opt.output_dim,
        "initial_state": "warm" if any(bool(c.h0.any() or c.c0.any()) for c in cells) else "zero",
        "token_mapping": write_mapping(folder) if write_mapping else {"family": BILM_TF},
        "tokenizer": {"name": "moses", "language": language},
        "sources": {kind: {"file": Path(p).name, "sha256": sha256(p)} for kind, p in (sources or {}).items()},
        "graph_version": GRAPH_VERSION,
        "opset": OPSET,
        "onnx_version": onnx.__version__,
        "onnxruntime_version": ort.__version__,
        "torch_version": torch.__version__,
    }


def check_sentences(mapping) -> list[list[str]]:
    """CHECK_SENTENCES and one more that holds every character the model's char table can be fed, so that a
    changed row of the char embedding changes a canary: for bilm-tf's byte mapping every byte UTF-8 text can
    hold (243 of 256: never 0xC0, 0xC1 or 0xF5-0xFF), for ELMoForManyLangs every character of its char.dic;
    cut into tokens the mapping reads whole (max_chars - 2 bytes or characters). The five sentences before it
    used 49 byte values: a copy of model.onnx with the row of 'Z' changed passed them with error 0."""
    if isinstance(mapping, BilmTfMapping):
        chars = [chr(c) for c in range(0x80)] + [chr(c) for c in range(0x80, 0xC0)]  # ASCII; C2 + 80-BF
        chars += [chr((lead & 0x1F) << 6) for lead in range(0xC3, 0xE0)]  # two-byte leads C3-DF
        chars += ["\u0800"] + [chr((lead & 0x0F) << 12) for lead in range(0xE1, 0xF0)]  # three-byte leads E0-EF
        chars += [chr(0x10000), chr(0x40000), chr(0x80000), chr(0xC0000), chr(0x100000)]  # four-byte F0-F4
        room, size = mapping.max_bytes, lambda c: len(c.encode("utf-8"))
    else:
        chars = sorted(c for c in mapping.chars if len(c) == 1)
        room, size = mapping.max_chars - 2, lambda c: 1
    tokens, token, used = [], "", 0
    for char in chars:
        if used + size(char) > room:
            tokens.append(token)
            token, used = "", 0
        token, used = token + char, used + size(char)
    return [*CHECK_SENTENCES, [*tokens, token]]


def _check_graphs(graphs: list[dict], folder: Path, want: list[np.ndarray], check: list[list[str]]) -> list[np.ndarray]:
    """Each fp32 graph within TOLERANCE of PyTorch's `want` on the CPU (ExportError otherwise), each reduced
    precision's distance from fp32 recorded in its entry; returns the fp32 Loop graph's layers."""
    fp32 = None
    for graph in graphs:  # the fp32 Loop graph first: the others are measured against it
        engine = Engine(folder, provider="cpu", graph=graph["file"], precision=graph["precision"])
        got = engine.run(check)
        del engine
        error = max_abs_error(got, want)
        if graph["precision"] == "fp32":
            if not error <= TOLERANCE:
                raise ExportError(
                    f"ONNX Runtime ({graph['kind']} graph) differs from PyTorch by {error:.3g} > {TOLERANCE} on the "
                    "check batch"
                )
            graph["parity"] = {"max_abs_error": error, "tolerance": TOLERANCE}
            fp32 = fp32 or got
        else:  # on the CPU's products at export (fp16's: bench/gpu.py measures it on the GPU)
            graph["accuracy"] = accuracy(got, fp32)
    return fp32


def _above_layer_0(graph: dict) -> float:
    return min(graph["accuracy"]["min_cosine_vs_fp32_by_layer"][1:])


def _int8_within_goal(model: BiLM, graph: dict, folder: Path, fp32: list[np.ndarray], check: list[list[str]]) -> None:
    """An int8 graph rewritten with its fallback scheme (INT8_FALLBACK, or INT8_VNNI_FALLBACK for the VNNI graph)
    when its scheme misses INT8_GOAL, and the better of the two kept, its scheme and accuracy in its manifest
    entry (the VNNI graph measured on its u8 twin, and left as the twin: the caller writes it afresh)."""
    fallback = INT8_VNNI_FALLBACK if "cpu_flags" in graph else INT8_FALLBACK
    if _above_layer_0(graph) >= INT8_GOAL or graph["quantization"] == fallback.to_dict():
        return
    first = Int8(**graph["quantization"])
    for scheme in (fallback, first):  # first back again if the fallback does no better
        model_proto = build_onnx_model(model, "int8", scheme)
        save_onnx(u8_twin(model_proto) if "cpu_flags" in graph else model_proto, folder / graph["file"])
        del model_proto
        engine = Engine(folder, provider="cpu", graph=graph["file"], precision="int8")
        measured = {"quantization": scheme.to_dict(), "accuracy": accuracy(engine.run(check), fp32)}
        del engine
        if scheme is first or _above_layer_0(measured) > _above_layer_0(graph):
            graph.update(measured)
            return


def _replace_export(folder: Path, out_dir: Path) -> None:
    """Move a finished export into out_dir, removing an earlier export's graphs, mapping and canaries first."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stale = [*out_dir.glob("model*.onnx*"), *out_dir.glob("*.dic"), *out_dir.glob(CANARIES_FILE)]
    for path in stale:
        path.unlink()
    for item in folder.iterdir():
        shutil.move(str(item), out_dir / item.name)


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
