"""What the benchmarks share: the full-size published architecture with random weights, and the fixture text."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FULL_OPTIONS = ROOT / "bench" / "configs" / "elmo_2x4096_512_2048cnn_2xhighway_options.json"
TINY = ROOT / "tests" / "fixtures" / "elmo-tiny"
SENTENCES = TINY / "sentences_flat.json"
BUILD = ROOT / "build" / "bench"


def fixture_sentences() -> list[list[str]]:
    return json.loads(SENTENCES.read_text())


def full_size_model(options: Path = FULL_OPTIONS, seed: int = 0, window: int | None = None) -> Path:
    """Export (once, cached under build/bench/) a model of the given architecture with random weights,
    written to and read back from the published hdf5 layout first, as a real ELMo would be. The export is
    in `onnx/` (the window graphs' default window), or in `onnx-w<window>/` for another window."""
    from model_export.options import load_options
    from model_export.weights import random_bilm, write_published_weights

    out = BUILD / f"{options.stem}-seed{seed}"
    if not (out / "weights.hdf5").exists():
        out.mkdir(parents=True, exist_ok=True)
        (out / "options.json").write_text(options.read_text())
        write_published_weights(random_bilm(load_options(options), seed=seed), out / "weights.hdf5")
    _export_once(out / "options.json", out / "weights.hdf5", out / onnx_folder("onnx", window), window)
    return out


def tiny_model(window: int | None = None) -> Path:
    """The tiny fixture biLM (output dim 32) exported once under build/bench/, as the tests export it
    (`elmo-tiny/`, or `elmo-tiny-w<window>/` for another window than the default)."""
    out = BUILD / onnx_folder("elmo-tiny", window)
    _export_once(TINY / "options.json", TINY / "lm_weights.hdf5", out, window)
    return out


def onnx_folder(name: str, window: int | None) -> str:
    from model_export.export import WINDOW

    return name if window in (None, WINDOW) else f"{name}-w{window}"


def _export_once(options: Path, weights: Path, out: Path, window: int | None) -> None:
    """Export unless `out` already holds this graph version with the graphs (window, int8 scheme) an export writes
    now, and canaries: an export cached before a new graph or scheme was added is written again."""
    from model_export.export import WINDOW, export_model, graph_list
    from model_export.weights import load_bilm
    from service.manifest import GRAPH_VERSION

    window = window or WINDOW
    manifest = out / "manifest.json"
    if manifest.exists():
        written = json.loads(manifest.read_text())
        keys = ("file", "kind", "precision", "window", "quantization")
        have = [{key: g.get(key) for key in keys} for g in written.get("graphs", [])]
        want = [{key: g.get(key) for key in keys} for g in graph_list(window)]
        if written.get("graph_version") == GRAPH_VERSION and "canaries" in written and have == want:
            return
    sources = {"options": options, "weights": weights}
    export_model(load_bilm(options, weights), out, sources, window=window)


def in_turn(runs: dict, batches: list, *, seconds: float = 0.0, rounds: int = 1) -> dict[str, float]:
    """Tokens/s of each of `runs` (name -> a callable taking a batch): every batch run by each in turn, so that a
    loaded machine slows them alike, after one warm-up batch each; at least `rounds` passes over the batches and
    until each has had about `seconds`."""
    for run in runs.values():
        run(batches[0])
    spent, tokens, passes, start = dict.fromkeys(runs, 0.0), 0, 0, time.perf_counter()
    while passes < rounds or time.perf_counter() - start < seconds * len(runs):
        for batch in batches:
            for name, run in runs.items():
                begin = time.perf_counter()
                run(batch)
                spent[name] += time.perf_counter() - begin
            tokens += sum(map(len, batch))
        passes += 1
    return {name: tokens / s for name, s in spent.items()}


def percentiles(values: list[float], qs=(50, 95, 99)) -> dict[str, float]:
    return {f"p{q}": float(np.percentile(values, q)) for q in qs}


def _limit_open_files(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))


def start_server(
    model: Path,
    threads: int = 1,
    settings: dict[str, str] | None = None,
    log: Path | None = None,
    root: Path = ROOT,
    open_files: int | None = None,
) -> tuple[subprocess.Popen, str, int]:
    """A real elmo-serve on 127.0.0.1 with the default limits (no ELMO_* setting of this shell, but `settings`),
    on the CPU with `threads` ONNX Runtime threads, its output to `log` if given; returns the process, its URL and
    port once it is ready. `root`: the checkout whose code it serves (another one gives before-and-after figures);
    `open_files`: its open-files limit, soft and hard (as a host with that limit would start it)."""
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELMO_")}
    env |= {"ELMO_PROVIDER": "cpu", "ELMO_INTRA_OP_THREADS": str(threads), "ELMO_INTER_OP_THREADS": "1"}
    env |= {"ELMO_LOG_LEVEL": "warning", **(settings or {})}
    out = None if log is None else log.open("wb")
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys; from service.cli import serve_main; sys.exit(serve_main())",
         "--model", str(model), "--port", str(port)],
        cwd=root, env=env, stdout=out, stderr=None if out is None else subprocess.STDOUT,
        preexec_fn=None if open_files is None else partial(_limit_open_files, open_files),
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health/ready").status_code == 200:
                return server, url, port
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or server.poll() is not None:
            server.kill()
            raise SystemExit("elmo-serve did not become ready")
        time.sleep(0.2)
