"""elmo-embed --engine ray: a job's parts (service/bulk/parts.py) embedded by a pool of Ray Data actors, an engine
each, on a Ray cluster or a local Ray started and stopped here.

Each actor loads the model once and checks its canaries, then embeds whole parts with the one-machine pipeline
(service/bulk/pipeline.py), each into its own part file on the shared file system; the driver only plans the parts,
counts what comes back and, for hdf5, merges the parts into the one output at the end: it never holds the corpus or
its vectors. Faults cost a retry: Ray Data restarts a killed actor and runs its part again (`max_restarts` and
`max_task_retries` are unbounded on an actor pool), and where a node is gone the surviving actors take the parts
left; a part file appears only whole, so a part run twice is written once. A line the model refuses comes back as
the part's error and stops the job naming the file and line (or, with --skip-bad-lines, is listed and skipped).
The inputs, the model folder and the output's folder must be at the same paths on every node (a shared volume).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import resource
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np
from tqdm import tqdm

from service.bulk.inputs import InputError, Span
from service.bulk.parts import Job
from service.bulk.pipeline import Output, embed_file

# A local Ray's object store: only the parts' counts travel through it (the vectors go to files), so a small one
LOCAL_OBJECT_STORE_BYTES = 256 << 20


@dataclass(frozen=True)
class Cluster:
    """Where the actors run: `address` (None: a local Ray, started and stopped by this run; "auto": the cluster this
    machine is part of; HOST:PORT), how many (None: as many as the cluster's CPUs, or GPUs, allow), and what each
    takes: `threads` CPUs (ONNX Runtime's intra-op threads) and `gpus` GPUs."""

    address: str | None = None
    actors: int | None = None
    threads: int = 1
    gpus: float = 0


@dataclass(frozen=True)
class EngineArgs:
    """What each actor's engine is made with, and what its canaries' disagreement does (refuse or warn)."""

    model: str
    provider: str = "auto"
    precision: str = "fp32"
    device_id: int = 0
    cuda_graphs: bool = False
    batch_tokens: int | None = None
    canary: str = "refuse"


class PartEmbedder:
    """A Ray Data actor: one engine, loaded once; each call embeds whole parts into their files and returns what it
    did (or the error that stopped a part: a bad line, the canaries)."""

    def __init__(self, engine: dict, threads: int, job: dict):
        import ray

        from service.engine import canary
        from service.engine.session import Engine
        from service.manifest import verify_files
        from service.settings import default_batch_tokens

        args = EngineArgs(**engine)
        self.engine = Engine(args.model, provider=args.provider, intra_op_threads=threads, precision=args.precision,
                             device_id=args.device_id, cuda_graphs=args.cuda_graphs)  # fmt: skip
        self.batch_tokens = args.batch_tokens or default_batch_tokens(self.engine.provider)
        self.node = ray.get_runtime_context().get_node_id()
        try:  # what the local run checks: the files as exported (sha256), as elmo-serve checks, and the canaries
            verify_files(self.engine.info, self.engine.graph)
        except ValueError as err:
            self.refused = f"on node {self.node[:8]}: {err}"
            return
        report = canary.check(self.engine, canary.MARGIN)
        disagree = report.checked and not report.passed and args.canary == "refuse"
        self.refused = f"on node {self.node[:8]}: {report.describe()} (--canary warn embeds anyway)" if disagree else ""
        self.job = job

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        rows = [self._embed(int(index)) for index in batch["part"]]
        return {key: [row[key] for row in rows] for key in rows[0]}

    def _embed(self, index: int) -> dict:
        job = self.job
        started = time.perf_counter()
        row = {"part": index, "error": self.refused, "sentences": 0, "tokens": 0, "seconds": 0.0, "bad": "[]",
               "node": self.node, "pid": os.getpid(), "rss_mb": 0.0}  # fmt: skip
        if not self.refused:
            bad: list = []
            stamp = json.dumps({**json.loads(job["output"]["about"]), "part": index}, sort_keys=True)
            path = os.path.join(job["folder"], job["names"][index])
            on_bad = (lambda *line: bad.append(line)) if job["skip_bad"] else None
            try:
                stats = embed_file(self.engine, [Span(**job["spans"][index])], path, self.batch_tokens,
                                   progress=False, output=Output(**{**job["output"], "about": stamp}),
                                   dtype=job["dtype"], writer="thread", on_bad=on_bad)  # fmt: skip
                row.update(sentences=stats["sentences"], tokens=stats["tokens"], bad=json.dumps(bad))
            except InputError as err:  # a bad line: the job stops, and may go on without it
                row["error"] = (f"{err}; the parts written are kept in {job['folder']}: --resume --skip-bad-lines "
                                "goes on without that line")  # fmt: skip
            except OSError as err:  # the shared volume full or gone: said in one line, as the local run says it
                row["error"] = f"part {index} on node {self.node[:8]}: {err}"
        row["seconds"] = time.perf_counter() - started
        row["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return row


def embed_on_ray(job: Job, engine: EngineArgs, output: Output, dtype: str, cluster: Cluster, skip_bad: bool = False,
                 progress: bool = True) -> dict:  # fmt: skip
    """Embed the job's parts not yet written; returns counts, timing, the lines skipped and the peak memory."""
    todo = job.todo()
    started = time.perf_counter()
    actors = min(cluster.actors, max(1, len(todo)))
    total = sum(part.span.lines or 0 for part in job.parts)
    left = sum(part.span.lines or 0 for part in todo)
    bar = tqdm(total=total, initial=total - left, unit=" lines", disable=not progress, desc="elmo-embed ray")
    stats = {"parts": len(job.parts), "parts_done_before": len(job.parts) - len(todo), "actors": actors,
             "sentences": 0, "tokens": 0, "bad": [], "nodes": set(), "workers_rss_mb": 0.0}  # fmt: skip
    if todo:
        for row in _parts_embedded(job, todo, engine, output, dtype, cluster, actors, skip_bad):
            if row["error"]:
                raise InputError(row["error"])
            stats["sentences"] += row["sentences"]
            stats["tokens"] += row["tokens"]
            stats["bad"] += json.loads(row["bad"])
            stats["nodes"].add(row["node"])
            stats["workers_rss_mb"] = max(stats["workers_rss_mb"], row["rss_mb"])
            bar.update(job.parts[row["part"]].span.lines or 0)
            bar.set_postfix(tokens_per_s=f"{stats['tokens'] / (time.perf_counter() - started):.0f}")
    bar.close()
    import ray

    stats["addresses"] = sorted({node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]})
    seconds = time.perf_counter() - started
    stats.update(seconds=seconds, tokens_per_s=stats["tokens"] / seconds, nodes=len(stats["nodes"]),
                 driver_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # fmt: skip
    return stats


def _parts_embedded(job: Job, todo, engine: EngineArgs, output: Output, dtype: str, cluster: Cluster, actors: int,
                    skip_bad: bool):  # fmt: skip
    """The rows of the actors' calls, one a part, as they finish (in any order)."""
    import ray.data

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # the driver's own bar counts lines
    context.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    described = {"folder": str(job.folder), "names": [part.name(job.format) for part in job.parts],
                 "spans": [asdict(part.span) for part in job.parts], "output": asdict(output), "dtype": dtype,
                 "skip_bad": skip_bad}  # fmt: skip
    parts = ray.data.from_items([{"part": part.index} for part in todo], override_num_blocks=len(todo))
    embedded = parts.map_batches(
        PartEmbedder,
        fn_constructor_kwargs={"engine": asdict(engine), "threads": cluster.threads, "job": described},
        batch_size=1,
        # one part at a time an actor: a part queued behind a slow (or dead) actor would hold the job's end
        compute=ray.data.ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=1),
        num_cpus=cluster.threads,
        num_gpus=cluster.gpus or None,
    )
    yield from embedded.iter_rows()


@contextlib.contextmanager
def connected(cluster: Cluster) -> Iterator[Cluster]:
    """Ray connected (a local Ray started, where no address is given, and stopped after), and the cluster with its
    number of actors decided."""
    _connect(cluster.address)
    import ray
    import ray.exceptions

    try:
        allowed = _actors_allowed(cluster)
        if cluster.address is None and cluster.actors and cluster.actors > allowed:  # they would wait for ever
            has = ray.cluster_resources()
            raise InputError(f"--actors {cluster.actors} of --threads {cluster.threads} CPUs and --gpus-per-actor "
                             f"{cluster.gpus} need more than the local Ray's {has.get('CPU', 0):.0f} CPUs and "
                             f"{has.get('GPU', 0):.0f} GPUs: give fewer, or --address a cluster")  # fmt: skip
        yield dataclasses.replace(cluster, actors=cluster.actors or allowed)
    except ray.exceptions.RayError as err:  # Ray's own failures, in a line (their text is pages long)
        raise RuntimeError(f"the Ray run failed: {str(err).strip().splitlines()[0]}") from None
    finally:
        ray.shutdown()  # a cluster's own processes go on; a local Ray's end


def _connect(address: str | None) -> None:
    """ray.init: a local Ray (address None) on the loopback alone, or the cluster at `address`. Ray is imported
    here, not with this module: whether a local Ray's addresses are the loopback's is read once, when Ray is first
    imported (Ray on Linux otherwise resolves 127.0.0.1 to the host's network address)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address is None:
        # an unauthenticated Ray reachable from the network runs anyone's code: a local one listens on 127.0.0.1
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    if address is None:
        ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False,
                 object_store_memory=LOCAL_OBJECT_STORE_BYTES)  # fmt: skip
    else:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)


def _actors_allowed(cluster: Cluster) -> int:
    import ray

    resources = ray.cluster_resources()
    if cluster.gpus:
        return max(1, int(resources.get("GPU", 0) // cluster.gpus))
    return max(1, int(resources.get("CPU", 1) // cluster.threads))
