"""Canaries: an engine proves its graph on this machine before it serves.

elmo-export keeps its check sentences in the model folder as canaries (`canaries.npz`: each sentence's layers
from the reference graph, the fp32 Loop graph on the CPU, at export). At start-up an engine embeds them and
compares: an fp32 graph must agree within FP32_TOLERANCE (the project's bar), a reduced-precision one within the
error its export measured and stated in the manifest, plus a margin for another CPU's or a GPU's rounding. Beyond
that the numbers are not what the export promised (a graph file altered or damaged, a provider that computes
otherwise, a kernel that saturates), and the service refuses to start (ELMO_CANARY=warn: it says so and serves).
The reference graph is checked too: it is a few milliseconds, and a damaged model.onnx is caught the same way.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger("elmo.canary")
CANARIES_FILE = "canaries.npz"
FP32_TOLERANCE = 1e-5  # max abs error of an fp32 graph, everywhere (README)
# How far beyond its stated error a reduced precision's canaries may go, by default (ELMO_CANARY_MARGIN): room for
# another CPU's or a GPU's rounding, far below what a damaged graph or a saturating kernel shows.
MARGIN = 0.5


def max_abs_error(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max(initial=0.0)) for x, y in zip(a, b, strict=True))


def cosine_min(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """The smallest cosine between corresponding vectors (every layer, every token) of two results; two zero
    vectors agree (cosine 1)."""
    x, y = (np.concatenate([layers.reshape(-1, layers.shape[-1]) for layers in r]).astype(np.float64) for r in (a, b))
    dots, norms = (x * y).sum(axis=1), np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1)
    both_zero = (np.abs(x).max(axis=1, initial=0) == 0) & (np.abs(y).max(axis=1, initial=0) == 0)
    return float(np.min(np.where(both_zero, 1.0, dots / np.maximum(norms, 1e-30)), initial=1.0))


def accuracy(got: list[np.ndarray], fp32: list[np.ndarray]) -> dict:
    """A reduced-precision result's distance from fp32: max abs error and min cosine per token vector over every
    layer, and the min cosine of each layer (layer 0, the token vectors, first)."""
    return {
        "max_abs_error_vs_fp32": max_abs_error(got, fp32),
        "min_cosine_vs_fp32": cosine_min(got, fp32),
        "min_cosine_vs_fp32_by_layer": [
            cosine_min([x[k : k + 1] for x in got], [y[k : k + 1] for y in fp32]) for k in range(fp32[0].shape[0])
        ],
    }


def save_canaries(path: Path, sentences: list[list[str]], layers: list[np.ndarray]) -> None:
    """Each canary sentence's layers (num_layers, n_tokens, dim) float32, in order (the sentences themselves go
    in the manifest)."""
    pairs = enumerate(zip(sentences, layers, strict=True))
    np.savez(path, **{f"s{i}": np.asarray(a, np.float32) for i, (_, a) in pairs})


class CanaryMismatch(RuntimeError):
    """An engine's canaries disagree with the reference beyond what its graph may."""


@dataclass(frozen=True)
class CanaryReport:
    """What the start-up check found (/info shows it, the metrics carry its figures)."""

    graph: str  # the graph file served
    precision: str
    provider: str
    checked: bool  # False: an export without canaries (elmo-export before they existed)
    passed: bool | None = None
    sentences: int = 0
    tokens: int = 0
    max_abs_error: float | None = None
    min_cosine: float | None = None
    allowed_max_abs_error: float | None = None
    allowed_min_cosine: float | None = None  # None: not bounded (fp32: the max abs error bounds it)
    bound: str = ""  # where the allowance comes from
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        where = f"graph {self.graph} ({self.precision}) on {self.provider}"
        if not self.checked:
            return f"{where}: not checked (this export has no canaries: export it again with elmo-export)"
        cosine = f", min cosine {self.min_cosine:.6f}"
        if self.allowed_min_cosine is not None:
            cosine += f" (allowed >= {self.allowed_min_cosine:.6f})"
        return (
            f"{where}: canaries {'agree' if self.passed else 'DISAGREE'} with the reference on {self.sentences} "
            f"sentences ({self.tokens} tokens): max abs error {self.max_abs_error:.3g} (allowed <= "
            f"{self.allowed_max_abs_error:.3g}, {self.bound}){cosine}"
        )


def allowance(entry: dict, margin: float) -> tuple[float, float | None, str]:
    """(max abs error, min cosine or None, why) a graph may show against the reference: FP32_TOLERANCE for fp32;
    for a reduced precision, the error its export stated, `margin` (a fraction) beyond it."""
    if entry.get("precision", "fp32") == "fp32":
        return FP32_TOLERANCE, None, "the fp32 bar"
    stated = entry.get("accuracy")
    if not stated:
        raise CanaryMismatch(f"the manifest states no accuracy for {entry.get('file')}: export it again")
    max_abs = stated["max_abs_error_vs_fp32"] * (1 + margin) + FP32_TOLERANCE
    min_cosine = 1 - (1 - stated["min_cosine_vs_fp32"]) * (1 + margin)
    return max_abs, min_cosine, f"the stated {stated['max_abs_error_vs_fp32']:.3g} + {margin:.0%}"


def check(engine, margin: float) -> CanaryReport:
    """Run the model folder's canaries on `engine` (an Engine, nothing in flight) and compare them with the
    reference layers."""
    manifest, graph = engine.info.manifest, engine.graph
    given = {"graph": graph.file.name, "precision": graph.precision, "provider": engine.provider}
    canaries = manifest.get("canaries")
    if not canaries:
        return CanaryReport(**given, checked=False)
    sentences = canaries["sentences"]
    with np.load(graph.file.parent / canaries["file"]) as data:
        want = [data[f"s{i}"] for i in range(len(sentences))]
    start = time.perf_counter()
    got = engine.run(sentences)
    seconds = time.perf_counter() - start
    error, cosine = max_abs_error(got, want), cosine_min(got, want)
    max_abs, min_cosine, bound = allowance(graph.entry, margin)
    passed = error <= max_abs and (min_cosine is None or cosine >= min_cosine)
    return CanaryReport(
        **given,
        checked=True,
        passed=passed,
        sentences=len(sentences),
        tokens=sum(map(len, sentences)),
        max_abs_error=error,
        min_cosine=cosine,
        allowed_max_abs_error=max_abs,
        allowed_min_cosine=min_cosine,
        bound=bound,
        seconds=round(seconds, 4),
    )


def prove(engine, name: str, mode: str = "refuse", margin: float = MARGIN) -> CanaryReport:
    """Check `engine` (the model `name`) and say what was found; with `mode` "refuse", a mismatch raises
    CanaryMismatch naming graph, provider and figures (with "warn" it is logged as an error, and serves)."""
    report = check(engine, margin)
    line = f"model {name!r}: {report.describe()}"
    if not report.checked:
        log.warning(line)
    elif report.passed:
        log.info(line)
    elif mode == "refuse":
        raise CanaryMismatch(f"{line}; refusing to serve it (ELMO_CANARY=warn serves it anyway)")
    else:
        log.error(f"{line}; serving it anyway (ELMO_CANARY=warn)")
    return report
