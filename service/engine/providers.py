"""ONNX Runtime's side of an engine: one runtime installed, the providers asked for, the CUDA provider's options,
and where ONNX Runtime placed the graph's nodes (its verbose session log), so a GPU deployment that would run on
the CPU, or copy to the host at every call, is refused or named."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import onnxruntime as ort

from service.engine.native import library
from service.manifest import Graph, ModelInfo

log = logging.getLogger("elmo.engine")


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


CUDA = "CUDAExecutionProvider"


def session_options(intra_op_threads: int, inter_op_threads: int, kernels: bool = True) -> ort.SessionOptions:
    """The options of every session; `kernels`: register this project's kernels where the install built them
    (`kernels_library`)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads  # 0: one per core
    options.inter_op_num_threads = inter_op_threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # ONNX Runtime keeps a memory pattern for each distinct set of input shapes it has seen, for good; with
    # this graph's shapes (rows, length, distinct and cached tokens) that set keeps growing: an engine fed
    # 10 000 batches of varied shapes grew +13% and was still growing. Off, it levels off, at the same speed.
    options.enable_mem_pattern = False
    library = kernels_library() if kernels else None
    if library:
        options.register_custom_ops_library(str(library))
    return options


@functools.cache
def kernels_library() -> Path | None:
    """The compiled kernels of ElmoCellStep and ElmoQuantizeRows (service/engine/native/), said once in the log, or
    None: then the graphs compute those ops in their standard ONNX ops (the same numbers, slower)."""
    found = library()
    if found:
        log.info("ElmoCellStep, ElmoQuantizeRows: this project's kernels, %s", found.name)
    else:
        log.warning(
            "ElmoCellStep, ElmoQuantizeRows: no compiled kernels in this install (pip builds them where it finds a "
            "C++ compiler): the graphs run their standard ONNX ops, the same numbers, slower"
        )
    return found


def open_graph(
    info: ModelInfo,
    provider: str,
    precision: str,
    graph: str,
    options: ort.SessionOptions,
    device_id: int = 0,
    cuda_graphs: bool = False,
) -> tuple[Graph, ort.InferenceSession]:
    """The graph of `info` to serve on `provider` ("auto", "cuda" or "cpu") in `precision`, and its session.
    "auto" graph: the Loop graph on the CPU in fp32 or int8 (measured the faster one there: bench/engine.py), else
    the window graph (CUDA, fp16); "loop", "window", or a file the manifest lists (`choose_graph`: the int8 Loop
    graph by the CPU's flags). On CUDA, a fallback to the CPU is refused when CUDA was asked for (a GPU
    deployment would look healthy at a fraction of its speed) and said in the log under "auto"; nodes placed off
    the GPU are refused for the window graph and named for the Loop graph."""
    if precision == "int8":
        # The int8 graph is written for ONNX Runtime's CPU kernels (MatMulIntegerToFloat, with per-row scales
        # measured on CPUs only, never on a GPU): "auto" means the CPU for it, and CUDA is refused.
        if provider == "cuda":
            raise RuntimeError(
                "precision int8 runs on the CPU only (its graph is written for ONNX Runtime's CPU kernels and "
                "was never measured on a GPU): use provider cpu or auto for int8, or precision fp32 or fp16 on CUDA"
            )
        provider = "cpu"
    cuda = choose_providers(provider)[0] == CUDA
    chosen, session, placement = _open(info, cuda, graph, precision, options, device_id, cuda_graphs)
    if cuda and session.get_providers()[0] != CUDA:
        # ONNX Runtime falls back to the CPU with a warning when CUDA cannot start (no GPU visible, a CUDA or cuDNN
        # library missing).
        if provider == "cuda":
            raise RuntimeError(
                f"provider 'cuda' asked for, but ONNX Runtime could not start {CUDA} and fell back to "
                f"{session.get_providers()[0]}: is a GPU visible, and are the CUDA and cuDNN libraries "
                f"onnxruntime-gpu {ort.__version__} needs installed?"
            )
        log.warning("no usable GPU (ONNX Runtime fell back to the CPU): serving the CPU's graph on the CPU")
        chosen, session, placement = _open(info, False, graph, precision, options, device_id, cuda_graphs)
    elif cuda:
        check_placement(chosen, placement)
    return chosen, session


def check_placement(graph: Graph, placement: str) -> None:
    """Refuse a window graph with nodes off the GPU (each means copies to and from the host at every call, and no
    CUDA graph); name them for the Loop graph, whose shape computations ONNX Runtime keeps on the CPU by design."""
    off = nodes_off(placement, CUDA)
    if off is None:
        log.warning("ONNX Runtime's placement report was not found in its log: node placement unchecked")
    elif off and graph.kind == "loop":
        log.warning(
            "provider 'cuda', the Loop graph: ONNX Runtime placed %d node(s) of %s off the GPU (as it does for a "
            "Loop's shape computations): %s",
            len(off),
            graph.file.name,
            ", ".join(off[:10]),
        )
    elif off:
        raise RuntimeError(
            f"provider 'cuda': ONNX Runtime placed {len(off)} node(s) of {graph.file.name} off the GPU: "
            + ", ".join(off[:10])
        )


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags as Linux's /proc/cpuinfo names them (none known elsewhere)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def choose_graph(info: ModelInfo, graph: str, precision: str) -> Graph:
    """The manifest's graph of kind `graph` ("loop", "window", or a file the manifest lists) in `precision`. Of
    several int8 Loop graphs, the first whose `cpu_flags` this CPU has one of (the VNNI graph: 8-bit products
    that only VNNI and AMX compute without saturating), else the one without `cpu_flags` (exact on every x86
    CPU); the choice goes to the log, and /info shows the graph served."""
    if graph.endswith(".onnx"):  # one file, as elmo-export measures each
        for entry in info.graphs:
            if entry.file.name == graph and entry.precision == precision:
                return entry
        raise ValueError(f"this model folder has no graph {graph} in {precision}")
    candidates = [g for g in info.graphs if g.kind == graph and g.precision == precision]
    if graph != "loop" or precision != "int8" or len(candidates) < 2:
        return info.graph(graph, precision)
    have = cpu_flags()
    for entry in candidates:
        found = sorted(set(entry.entry.get("cpu_flags", ())) & have)
        if found:
            log.info("precision int8: this CPU has %s: serving %s (%s)", ", ".join(found), entry.file.name,
                     _scheme(entry))  # fmt: skip
            return entry
    plain = [g for g in candidates if not g.entry.get("cpu_flags")]
    if not plain:
        raise ValueError(f"this model folder's int8 graphs each need a CPU flag this CPU lacks: {candidates}")
    wanted = sorted({f for g in candidates for f in g.entry.get("cpu_flags", ())})
    log.info("precision int8: this CPU has none of %s: serving %s (%s)", ", ".join(wanted), plain[0].file.name,
             _scheme(plain[0]))  # fmt: skip
    return plain[0]


def _scheme(graph: Graph) -> str:
    return ", ".join(f"{k} {v}" for k, v in graph.entry.get("quantization", {}).items())


def _open(info: ModelInfo, cuda: bool, graph: str, precision: str, options, device_id: int, cuda_graphs: bool):
    """The graph to serve and its session (with its placement report on CUDA, else "")."""
    if graph == "auto":
        graph = "window" if cuda or precision == "fp16" else "loop"
    chosen = choose_graph(info, graph, precision)
    if not cuda:
        return chosen, ort.InferenceSession(str(chosen.file), options, providers=["CPUExecutionProvider"]), ""
    if hasattr(ort, "preload_dlls"):  # CUDA and cuDNN installed as pip packages (nvidia-*) are found
        ort.preload_dlls()
    capture = cuda_graphs and chosen.kind == "window"  # a graph with a Loop cannot be captured
    providers = [(CUDA, cuda_options(device_id, capture)), "CPUExecutionProvider"]
    return chosen, *placed_session(chosen.file, options, providers)
