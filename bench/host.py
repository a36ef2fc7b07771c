"""What the host does around the GPU, measured on the CPU with a null session (ONNX Runtime's place taken by a
stand-in that returns arrays of the right shapes at once, so everything else is timed):

    python -m bench.host [--rows 256,1024] [--calls 40] [--batches 1,32,256,1024] [--bulk-sentences 6000]
                         [--batcher-calls 20] [--writers thread,process] [--shapes default,full,full16]
                         [--only engine,batcher,efficiency,bulk] [--out build/bench/host]

1. the engine's own work per window-graph call (packing the rows, the token inputs, binding, the copy of the
   outputs into the host's pooled memory, which the null session writes as a device's copy would), at the
   full-size shape (output dim 1024, 3 layers), the fixture sentences streamed through the packer at each number
   of rows, as elmo-embed runs it (the next call's feeds built on another thread: the rest is the part still
   serial with the GPU); against the GPU time of a call of that many rows at the yardstick's speed on an H200
   (bench/gpu.py measures that speed: 143,545 tokens/s at 256 rows, 154,691 at 1024, the same math as one CUDA
   graph, docs/gpu.md), whose 10% is the goal; the bytes newly allocated per call in steady state (tracemalloc);
   and engine.run's padding efficiency on finite batches (`--batches`);
2. the service's batcher on the same null engine, each call waiting the yardstick's GPU time (the interpreter lock
   let go, as ONNX Runtime does), clients keeping the queue over the budget: the host's time per call still serial
   with the GPU, the output copy apart, with the overlap (the next call taken and its feeds built during a call)
   off and on, back to back;
3. elmo-embed's pipeline with a null engine: reading, planning, packing, placing and writing hdf5, on the fixture
   sentences repeated, into a folder on tmpfs where there is one (`--out-dir`): its tokens/s is the ceiling any
   engine can reach through it (goal: >= 300,000), printed beside the machine's own bound: one plain write of the
   same bytes into the same folder (a VM's tmpfs may take fresh pages at a few hundred MB/s), and the same bytes as
   one hdf5 dataset; at the full size in float32 and float16 (`--dtype float16`: half the bytes); with the writer
   thread and the writer process (`--writers`), back to back.

Prints a table with the CPU's model and flags, and writes OUT/host.json.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import json
import os
import pstats
import tempfile
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnxruntime as ort

from bench.common import BUILD, FULL_OPTIONS, ROOT, fixture_sentences
from bench.gpu import cpu_flags, host_cpu
from service.engine.packing import PackedRows
from service.engine.session import SPLIT_OUTPUTS, Engine, _WindowCalls
from service.engine.token_cache import TokenCache
from service.manifest import GRAPH_VERSION, Graph, ModelInfo
from service.settings import PROVIDER_BATCH_TOKENS
from service.text.token_ids import BilmTfMapping

WINDOW = 32
# The same math on an H200 as one CUDA graph (docs/gpu.md, bench/gpu.py's yardstick): tokens/s at these rows.
YARDSTICK_TOKENS_PER_S = {256: 143_545, 1024: 154_691}
HOST_SHARE_GOAL = 0.10
BULK_GOAL = 300_000


class _Value:
    """What an OrtValue gives back: its array."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def numpy(self) -> np.ndarray:
        return self.array


class _Binding:
    def __init__(self, session: NullSession):
        self.session, self.inputs, self.outputs, self.bound = session, {}, [], {}

    def bind_cpu_input(self, name: str, array: np.ndarray) -> None:
        self.inputs[name] = array

    def bind_ortvalue_input(self, name: str, value) -> None:
        self.inputs[name] = value

    def bind_output(self, name: str, device: str = "cpu", device_id: int = 0) -> None:
        self.outputs.append(name)

    def bind_ortvalue_output(self, name: str, value) -> None:
        self.outputs.append(name)
        self.bound[name] = value

    def get_outputs(self) -> list[_Value]:
        return self.values


class NullSession:
    """ONNX Runtime's session replaced: no compute, but the outputs bound to host memory are written, as the copy
    from the device writes them (from a buffer made once per shape: the device's), so the host's side of the
    output copy is timed; the other outputs come back as those buffers."""

    writes_outputs = True

    def __init__(self, info: ModelInfo, cell_dim: int, outputs: tuple[str, ...] = SPLIT_OUTPUTS):
        self.info, self.cell_dim, self.output_names = info, cell_dim, outputs
        self._zeros: dict[tuple, np.ndarray] = {}
        self.device_s = 0.0  # each call then waits this long, the interpreter lock let go, as for a GPU's call
        self.ends: list[float] = []  # when each call returned
        self.copies: list[float] = []  # each call's seconds writing its outputs (a GPU's copy from the device)

    def io_binding(self) -> _Binding:
        return _Binding(self)

    def get_providers(self) -> list[str]:
        return ["NullSession"]

    def get_outputs(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(name=name) for name in self.output_names]

    def run_with_iobinding(self, binding: _Binding, options=None) -> None:
        rows, positions = len(binding.inputs["source"]), len(binding.inputs["positions"])
        tokens, proj, layers = len(binding.inputs["token_chars"]), self.info.token_dim, self.info.num_layers
        shapes = {"layers": (layers, 2, positions, proj), "lstm_layers": (layers - 1, 2, positions, proj),
                  "token_layer": (positions, proj), "token_vectors": (tokens, proj)}  # fmt: skip
        binding.values = []
        start = time.perf_counter()
        for name in binding.outputs:
            kind = name.removesuffix("_next")
            shape = shapes.get(name) or (2, rows, proj if kind.startswith("h") else self.cell_dim)
            if shape not in self._zeros:
                self._zeros[shape] = np.zeros(shape, np.float32)
            device = self._zeros[shape]
            if name in binding.bound:  # the copy from the device into the host memory bound
                ctypes.memmove(binding.bound[name].data_ptr(), device.ctypes.data, device.nbytes)
            binding.values.append(_Value(device))
        self.copies.append(time.perf_counter() - start)
        if self.device_s:
            time.sleep(self.device_s)
        self.ends.append(time.perf_counter())


def null_engine(options: Path = FULL_OPTIONS, max_rows: int = 1024, token_cache: int = 50_000) -> Engine:
    """A window-graph Engine of `options`' shape whose session is a NullSession."""
    from model_export.options import load_options  # the architecture's sizes, as the export writes them

    opt = load_options(options)
    manifest = {"num_layers": opt.num_output_layers, "output_dim": opt.output_dim, "architecture": opt.to_dict(),
                "graph_version": GRAPH_VERSION}  # fmt: skip
    graph = Graph(Path("null.onnx"), "window", "fp32", WINDOW, {"file": "null.onnx"})
    info = ModelInfo(manifest, opt.num_output_layers, opt.output_dim, opt.max_chars, opt.proj_dim, (graph,),
                     BilmTfMapping(opt.max_chars))  # fmt: skip
    engine = Engine.__new__(Engine)
    engine.info, engine.token_cache, engine.max_rows = info, TokenCache(token_cache), max_rows
    engine.graph, engine.session = graph, NullSession(info, opt.cell_dim)
    engine.provider, engine.window, engine.device, engine._device_id = "NullSession", WINDOW, "cpu", 0
    engine.state_sizes = {f"{kind}{k}": size for k in range(opt.n_layers)
                          for kind, size in (("h", opt.proj_dim), ("c", opt.cell_dim))}  # fmt: skip
    engine._outputs = []
    engine._window = _WindowCalls(engine, cuda_graphs=False)
    return engine


def stream(packed: PackedRows, sentences: list[list[str]], calls: int) -> tuple[list[float], int, int]:
    """Stream the sentences (repeated) through `packed` as the service does (more waiting than a call starts):
    each call's host seconds, and the positions and tokens computed."""
    seconds, fed, tokens = [], 0, 0
    while len(seconds) < calls:
        while len(packed.waiting) < 3 * packed.max_rows:
            packed.admit([sentences[fed % len(sentences)]], [fed])
            fed += 1
        start = time.perf_counter()
        finished = packed.step()
        seconds.append(time.perf_counter() - start)
        tokens += sum(s.length - 2 for s in finished)
    return seconds, packed.computed, tokens


def engine_host(rows: int, calls: int, sentences: list[list[str]]) -> dict:
    engine = null_engine(max_rows=rows)
    packed = PackedRows(engine, prefetch=True)  # as elmo-embed runs it: the next call's feeds built beside a call
    stream(packed, sentences, 3)  # the token cache warms, the pool's blocks and the device's buffers are made
    allocated = _allocated_per_call(packed, sentences)
    warm_positions, warm_computed, prepared = packed.positions, packed.computed, packed.prepare_s
    seconds, _, _ = stream(packed, sentences, calls)
    ms = 1e3 * float(np.median(seconds))
    # the feeds of the next call are built while a call runs on the GPU: what is left is serial with it
    serial_ms = 1e3 * (sum(seconds) - (packed.prepare_s - prepared)) / calls
    positions = (packed.computed - warm_computed) / calls  # computed per call, padding included
    real = (packed.positions - warm_positions) / calls
    gpu_ms = 1e3 * (real * 25 / 27) / YARDSTICK_TOKENS_PER_S[rows] if rows in YARDSTICK_TOKENS_PER_S else None
    profile = cProfile.Profile()
    profile.runcall(stream, packed, sentences, 5)
    top = pstats.Stats(profile).sort_stats("tottime").stats
    heaviest = sorted(((v[2], f"{Path(k[0]).name}:{k[2]}") for k, v in top.items()), reverse=True)[:6]
    return {
        "rows": rows,
        "host_ms_per_call": ms,
        "host_ms_p90": 1e3 * float(np.percentile(seconds, 90)),
        "serial_ms_per_call": serial_ms,
        "bytes_allocated_per_call": allocated,
        "positions_per_call": positions,
        "real_positions_per_call": real,
        "padding_efficiency": packed.efficiency,
        "yardstick_gpu_ms_per_call": gpu_ms,
        "host_share_of_gpu": ms / gpu_ms if gpu_ms else None,
        "serial_share_of_gpu": serial_ms / gpu_ms if gpu_ms else None,
        "output_blocks_made": engine._window.pool.allocated,
        "heaviest": [{"function": name, "seconds_in_5_calls": round(s, 4)} for s, name in heaviest],
    }


def batcher_host(rows: int, calls: int, sentences: list[list[str]], overlap: bool) -> dict:
    """The service's batcher on a null engine whose every call waits the yardstick's GPU time of a full call of
    `rows` rows (the interpreter lock let go, as ONNX Runtime does), fed by clients that keep more queued than a call
    takes: per call, the wall time between calls less that GPU time is the host's work still serial with the GPU
    (everything, without `overlap`; with it, what the preparing thread does not take off the engine thread). The
    clients' event loop is the service's: it shares the interpreter with both threads, as in the server."""
    import asyncio
    import itertools

    from service.batching.batcher import Batcher
    from service.batching.in_flight import in_flight

    engine = null_engine(max_rows=rows)
    gpu_s = rows * WINDOW * 25 / 27 / YARDSTICK_TOKENS_PER_S[rows]  # a full call's real tokens at the yardstick
    engine.session.device_s = gpu_s
    per_request, budget = 16, PROVIDER_BATCH_TOKENS["CUDAExecutionProvider"]
    request_tokens = sum(len(s) + 2 for s in sentences) * per_request / len(sentences)
    clients = int((budget + 2 * rows * WINDOW) / request_tokens) + 1  # the budget and two calls' worth queued
    warm = 4

    async def main() -> Batcher:
        batcher = Batcher(engine.run, in_flight(engine, WINDOW), budget, 0.0, 1 << 40, overlap=overlap)
        batcher.start()
        fed = itertools.count()

        async def client() -> None:
            while len(engine.session.ends) < warm + calls:
                await batcher.embed([sentences[next(fed) % len(sentences)] for _ in range(per_request)])

        await asyncio.gather(*(client() for _ in range(clients)))
        await batcher.stop()
        return batcher

    batcher = asyncio.run(main())
    ends = engine.session.ends[warm : warm + calls + 1]
    between = np.diff(ends)
    copy_s = float(np.median(engine.session.copies[warm + 1 : warm + calls + 1]))
    packed = batcher._in_flight.packed
    return {
        "rows": rows,
        "overlap": overlap,
        "clients": clients,
        "gpu_ms_per_call": 1e3 * gpu_s,
        "ms_between_calls": 1e3 * float(np.median(between)),
        "serial_ms_per_call": 1e3 * (float(np.median(between)) - gpu_s),
        "serial_ms_mean": 1e3 * (float(np.mean(between)) - gpu_s),
        "serial_share_of_gpu": (float(np.median(between)) - gpu_s) / gpu_s,
        "copy_ms_per_call": 1e3 * copy_s,  # in the serial part: the outputs' copy, a DMA from a GPU
        "serial_ms_less_copy": 1e3 * (float(np.median(between)) - gpu_s - copy_s),
        "replanned_calls": packed.replanned,
        "output_blocks_made": engine._window.pool.allocated,  # fresh blocks are first-touch writes: slow copies
        "padding_efficiency": packed.efficiency,
    }


def _allocated_per_call(packed: PackedRows, sentences: list[list[str]], calls: int = 4) -> int:
    """Bytes newly allocated at the peak of a call in steady state (tracemalloc, which numpy reports to): the
    median over `calls` calls."""
    tracemalloc.start()
    peaks = []
    try:
        for _ in range(calls):
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            stream(packed, sentences, 1)
            peaks.append(tracemalloc.get_traced_memory()[1] - base)
    finally:
        tracemalloc.stop()
    return int(np.median(peaks))


def run_efficiency(batches: list[int], sentences: list[list[str]]) -> dict[int, float]:
    """engine.run's padding efficiency on a finite batch of each size (the fixture sentences, repeated)."""
    engine = null_engine()
    out = {}
    for n in batches:
        engine.run([sentences[i % len(sentences)] for i in range(n)])
        out[n] = engine.run_efficiency
    return out


def bulk_ceiling(sentences: list[list[str]], count: int, out_dir: Path | None, options: Path,
                 dtype: str = "float32", writer: str = "process") -> dict:  # fmt: skip
    """elmo-embed's embed_file with a null engine of `options`' shape, writing datasets of `dtype` from the
    `writer` ("process": a process of its own, fed through shared memory; "thread": a thread of this process)."""
    from service.bulk import embed_file

    folder = Path(tempfile.mkdtemp(dir=out_dir or _tmpfs()))
    text = folder / "in.txt"
    text.write_text("".join(" ".join(sentences[i % len(sentences)]) + "\n" for i in range(count)))
    engine = null_engine(options)
    start = time.perf_counter()
    stats = embed_file(engine, text, folder / "out.hdf5", batch_tokens=65536, progress=False, dtype=dtype,
                       writer=writer)  # fmt: skip
    seconds = time.perf_counter() - start
    size = (folder / "out.hdf5").stat().st_size
    raw = _raw_write_seconds(folder / "raw.bin", size)
    one_dataset = _hdf5_write_seconds(folder / "one.hdf5", size)
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()
    return {"shape": options.parent.name if options.name == "options.json" else options.stem, "dtype": dtype,
            "output_dim": engine.dim, "sentences": stats["sentences"], "tokens": stats["tokens"], "seconds": seconds,
            "tokens_per_s": stats["tokens"] / seconds, "output_bytes": size, "bytes_per_s": size / seconds,
            "raw_write_bytes_per_s": size / raw, "write_bound_tokens_per_s": stats["tokens"] / raw,
            "hdf5_one_dataset_bytes_per_s": size / one_dataset, "writer": writer,
            "folder": str(folder.parent)}  # fmt: skip


def _raw_write_seconds(path: Path, size: int) -> float:
    """The machine's own bound: the seconds one plain write of `size` fresh bytes into that folder takes (new pages
    of memory or disk, as the hdf5 file's are); no pipeline writes its output faster than this."""
    data = np.ones(size, dtype=np.uint8)  # touched: the copy into the file, not the allocation, is timed
    start = time.perf_counter()
    with path.open("wb") as f:
        f.write(memoryview(data))
    return time.perf_counter() - start


def _hdf5_write_seconds(path: Path, size: int) -> float:
    """The same bytes as one float32 dataset through h5py (what hdf5 itself costs, without a dataset per sentence)."""
    import h5py

    data = np.ones(size // 4, dtype=np.float32)
    start = time.perf_counter()
    with h5py.File(path, "w") as f:
        f.create_dataset("all", data=data)
    return time.perf_counter() - start


def _tmpfs() -> Path | None:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="256,1024")
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--batches", default="1,32,256,1024", help="engine.run's batch sizes (padding efficiency)")
    parser.add_argument("--bulk-sentences", type=int, default=6000)
    parser.add_argument("--batcher-calls", type=int, default=20, help="the service batcher's calls, each mode")
    parser.add_argument("--only", default="engine,batcher,efficiency,bulk", help="which parts to run")
    parser.add_argument("--writers", default="thread,process", help="elmo-embed's hdf5 writers to measure")
    parser.add_argument("--shapes", default="default,full,full16", help="elmo-embed's shapes: default, full, full16")
    parser.add_argument("--out-dir", type=Path, help="where elmo-embed writes (default: /dev/shm, else /tmp)")
    parser.add_argument("--out", type=Path, default=BUILD / "host")
    args = parser.parse_args(argv)
    sentences = fixture_sentences()
    only = set(args.only.split(","))
    report = {"cpu": host_cpu(), "flags": cpu_flags(), "load": os.getloadavg(), "onnxruntime": ort.__version__,
              "engine": [], "batcher": [], "run_efficiency": {}, "bulk": []}  # fmt: skip
    for rows in (int(r) for r in args.rows.split(",")):
        if "engine" in only:
            report["engine"].append(engine_host(rows, args.calls, sentences))
        if "batcher" in only:  # back to back: the batcher in series, then overlapped
            for overlap in (False, True):
                report["batcher"].append(batcher_host(rows, args.batcher_calls, sentences, overlap))
    if "efficiency" in only:
        report["run_efficiency"] = run_efficiency([int(b) for b in args.batches.split(",")], sentences)
    # the embedded default model's shape (output dim 256), and the full size (1024: 12 KB of output per token, which
    # a machine's memory or disk may not take at this rate: the bytes written per second are printed beside it),
    # in float32 and float16
    shapes = {"default": (ROOT / "models" / "default" / "options.json", "float32"), "full": (FULL_OPTIONS, "float32"),
              "full16": (FULL_OPTIONS, "float16")}  # fmt: skip
    shapes = [shapes[name] for name in args.shapes.split(",")]
    if "bulk" in only:  # the thread writer (before) and the writer process (after), back to back
        report["bulk"] = [bulk_ceiling(sentences, args.bulk_sentences, args.out_dir, o, d, w) for o, d in shapes
                          for w in args.writers.split(",")]  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host.json").write_text(json.dumps(report, indent=2) + "\n")
    _print(report)


def _print(report: dict) -> None:
    load = ", ".join(f"{x:.1f}" for x in report["load"])
    print(f"host work around the GPU, null session; {report['cpu']}; {report['flags']}; load {load}; full-size shape")
    if report["engine"]:
        print("| rows | host ms per call (p90) | serial ms after overlap | bytes allocated per call | positions per "
              "call | padding efficiency | GPU ms at the yardstick | share (serial) | goal |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|")
    for e in report["engine"]:
        gpu = f"{e['yardstick_gpu_ms_per_call']:.1f}" if e["yardstick_gpu_ms_per_call"] else "n/a"
        share = f"{e['host_share_of_gpu']:.3f} ({e['serial_share_of_gpu']:.3f})" if e["host_share_of_gpu"] else "n/a"
        print(
            f"| {e['rows']} | {e['host_ms_per_call']:.2f} ({e['host_ms_p90']:.2f}) | {e['serial_ms_per_call']:.2f} | "
            f"{e['bytes_allocated_per_call'] / 1e6:.2f} MB | {e['positions_per_call']:.0f} | "
            f"{e['padding_efficiency']:.4f} | {gpu} | {share} | < {HOST_SHARE_GOAL} |"
        )
    for e in report["engine"]:
        print(
            f"  {e['rows']} rows, heaviest: "
            + ", ".join(f"{h['function']} {h['seconds_in_5_calls']}s" for h in e["heaviest"])
        )
    if report["batcher"]:
        print("the service's batcher, clients keeping the queue fuller than the budget; each call waits the "
              "yardstick's GPU time, the interpreter lock let go")  # fmt: skip
        print("| rows | overlap | GPU ms per call | ms between calls | serial host ms per call (mean) | share of GPU | "
              "of which the output copy | serial less the copy | calls planned again |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|")
    for b in report["batcher"]:
        print(
            f"| {b['rows']} | {'on' if b['overlap'] else 'off'} | {b['gpu_ms_per_call']:.1f} | "
            f"{b['ms_between_calls']:.1f} | {b['serial_ms_per_call']:.1f} ({b['serial_ms_mean']:.1f}) | "
            f"{b['serial_share_of_gpu']:.3f} | {b['copy_ms_per_call']:.1f} | {b['serial_ms_less_copy']:.1f} | "
            f"{b['replanned_calls']} |"
        )
    if report["run_efficiency"]:
        efficiencies = ", ".join(f"{n} sentences {eff:.3f}" for n, eff in report["run_efficiency"].items())
        print(f"engine.run padding efficiency (fixture sentences): {efficiencies}; goal >= 0.85 from 32")
    for b in report["bulk"]:
        print(
            f"elmo-embed with a null engine, {b['writer']} writer, {b['shape']} (output dim {b['output_dim']}, "
            f"{b['dtype']}): "
            f"{b['tokens_per_s']:,.0f} tokens/s ({b['sentences']} sentences, {b['tokens']} tokens, "
            f"{b['seconds']:.2f} s; {b['output_bytes'] / 1e6:.0f} MB, {b['bytes_per_s'] / 1e9:.2f} GB/s of hdf5 into "
            f"{b['folder']}); goal >= {BULK_GOAL:,}"
        )
        print(
            f"  the machine's bound there: one plain write of the same {b['output_bytes'] / 1e6:.0f} MB at "
            f"{b['raw_write_bytes_per_s'] / 1e9:.2f} GB/s, {b['write_bound_tokens_per_s']:,.0f} tokens/s (as one hdf5 "
            f"dataset: {b['hdf5_one_dataset_bytes_per_s'] / 1e9:.2f} GB/s); the pipeline reaches "
            f"{b['tokens_per_s'] / b['write_bound_tokens_per_s']:.2f} of it"
        )


if __name__ == "__main__":
    main()
