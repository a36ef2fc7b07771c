"""The folder elmo-export writes, as the service reads it: manifest.json names the graphs (their kind, precision and
window), the architecture's sizes, the token mapping and the tokenizer's language. Read without onnxruntime, so
that the exporter, the CLI's checks and the engine share one reading of it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from service.text.token_ids import Mapping, load_mapping

MANIFEST = "manifest.json"
# The graph this engine feeds (model_export/onnx_graph.py writes it): bumped whenever the graph changes (inputs,
# outputs or what it computes fast), or what the engine must feed it; an export of another version is refused.
# 7: the manifest's token_mapping (an ELMoForManyLangs export reads other ids, which an engine of version 6 would
# feed bytes to). 8: the window graph packs sentences into rows (resets, source) with both directions batched.
# Exports of versions 6 and 7 hold the same Loop graph (6: with the published byte mapping), still served; their
# window graphs are not (`WINDOW_GRAPH_VERSION`). 9: the window graph returns layer 0 once (`token_layer`) and
# slices its gates instead of an unequal Split; the engine still feeds an export of version 8's window graph.
# 10: the Loop graphs' faster bodies and the VNNI int8 graph (model_int8_vnni.onnx, issue 50): fed as version 9 is,
# but an export cached by version 9 (service/export_cache.py) lacks them, so it is made again.
# 11: the Loop graphs' steps as one ElmoCellStep node (an ONNX function, or this project's kernel of it: engine/native),
# fed as version 10 is; an export cached by version 10 is made again, for the kernel.
# 12: the int8 Loop graphs' LSTM products leave their rows' scales to the step (ElmoScaledCellStep), which ONNX
# Runtime applied in a pass of its own on one thread; fed as version 11 is, an export cached by 11 is made again.
GRAPH_VERSION = 12
READABLE_GRAPH_VERSIONS = (6, 7, 8, 9, 10, 11, 12)
WINDOW_GRAPH_VERSION = 8
# 3: the manifest records each file's sha256 (`files`), which start-up checks (`verify_files`).
FORMAT_VERSION = 3


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
    mapping: Mapping  # token -> the row of ints the graph reads (service/text/token_ids.py)

    @property
    def language(self) -> str:
        """Whose Moses rules the service tokenizes text with (service/text/moses.py; an older export: English)."""
        return self.manifest.get("tokenizer", {}).get("language", "en")

    def graph(self, kind: str, precision: str) -> Graph:
        if kind == "window" and self.manifest.get("graph_version", 0) < WINDOW_GRAPH_VERSION:
            raise ValueError(
                f"this model folder's window graph is of graph version {self.manifest.get('graph_version')}, "
                f"and this engine feeds version {WINDOW_GRAPH_VERSION}: export it again with elmo-export"
            )
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


def sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def files_read(info: ModelInfo, graph: Graph) -> list[Path]:
    """The files of a folder that serving `graph` reads: the graph (and its weights, if apart), the canaries and
    the token mapping's dictionaries."""
    files = [graph.file]
    if (data := graph.file.with_name(graph.file.name + ".data")).is_file():
        files.append(data)
    if canaries := info.manifest.get("canaries"):
        files.append(graph.file.with_name(canaries["file"]))
    mapping = info.manifest.get("token_mapping", {})
    files += [graph.file.with_name(mapping[key]) for key in ("chars", "words") if mapping.get(key)]
    return files


def verify_files(info: ModelInfo, graph: Graph) -> None:
    """Each file that serving `graph` reads has the sha256 its manifest records; ValueError naming the file
    otherwise. A manifest without sums (elmo-export before format 3) is refused too: a check that a changed
    folder could pass by leaving its sums out would check nothing. Either way: export it again (elmo-export
    records the sums of what it writes; accepting another folder's sums is its job, not the server's)."""
    folder = graph.file.parent
    sums = info.manifest.get("files")
    if not isinstance(sums, dict):
        raise ValueError(
            f"{folder / MANIFEST} records no sha256 of its files (format {info.manifest.get('format_version')}, "
            f"before {FORMAT_VERSION}): export it again with elmo-export"
        )
    for path in files_read(info, graph):
        want = sums.get(path.name)
        if want is None:
            raise ValueError(f"{folder / MANIFEST} records no sha256 of {path.name}: export it again with elmo-export")
        if (got := sha256(path)) != want:
            raise ValueError(
                f"{path}: its sha256 is {got}, and the manifest records {want}: the file was changed or damaged "
                "after export; export it again with elmo-export"
            )
