"""A real Ray cluster on this machine for the tests: a head node and worker nodes, each a process group of its own
(its raylet, object store and workers with it), 1 CPU each, no dashboard, usage statistics off, every service on
127.0.0.1. A node is ended, or killed as a machine is lost, by its group's id (never `ray stop`, never by name).

Run as a script: `python tests/ray_cluster.py head` starts a head node and prints {"address": ...};
`python tests/ray_cluster.py worker ADDRESS` starts a worker node that joins it and prints {"raylet": PID}. Each then
waits until it is killed. Ray's own `ray start` resolves 127.0.0.1 to the host's network address on Linux; this keeps
every socket on the loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in these processes, which only the CLI refuses for
worker nodes: these start their nodes through ray.cluster_utils and ray._private.node, as Ray's own tests do).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

NODE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
OBJECT_STORE_BYTES = 150 << 20


class Node:
    """One node's process group, started by this script."""

    def __init__(self, *args: str, log: Path):
        self.log = log
        env = {**os.environ, **NODE_ENV}
        self.proc = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, stderr=open(log, "w"),  # noqa: SIM115
                                     env=env, start_new_session=True, text=True)  # fmt: skip
        line = self.proc.stdout.readline()
        if not line:
            self.kill()
            raise RuntimeError(f"the Ray node did not start: {log.read_text()[-2000:]}")
        self.info = json.loads(line)

    def kill(self) -> None:
        """SIGKILL to the whole group (as a machine lost), and to the Ray workers its raylet started (each in a
        group of its own), and wait until none of them is left."""
        workers = descendants(self.proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()
        deadline = time.monotonic() + 30
        while (group_alive(self.proc.pid) or any(alive(pid) for pid in workers)) and (time.monotonic() < deadline):
            time.sleep(0.1)


def parents() -> dict[int, int]:
    """Every process's parent, from /proc."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            found[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    return found


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (its children, theirs, ...)."""
    children: dict[int, list[int]] = {}
    for child, parent in parents().items():
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie, ended but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def command(pid: int) -> bytes:
    """The process's title (Ray's workers set theirs: ray::MapWorker(...) for a Ray Data actor)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


class RayCluster:
    """A head and `workers` worker nodes; `kill()` ends them all."""

    def __init__(self, folder: Path, workers: int = 1):
        self.head = Node("head", log=folder / "ray-head.log")
        self.address = self.head.info["address"]
        self.workers = [Node("worker", self.address, log=folder / f"ray-worker-{i}.log") for i in range(workers)]

    def nodes(self) -> list[Node]:
        return [self.head, *self.workers]

    def kill(self) -> None:
        for node in reversed(self.nodes()):
            node.kill()


def _head() -> None:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                            "object_store_memory": OBJECT_STORE_BYTES})  # fmt: skip
    print(json.dumps({"address": cluster.address}), flush=True)


def _worker(address: str) -> None:
    import ray._private.node
    from ray._private.parameter import RayParams

    params = RayParams(gcs_address=address, num_cpus=1, num_gpus=0, object_store_memory=OBJECT_STORE_BYTES,
                       min_worker_port=0, max_worker_port=0, node_manager_port=0, include_log_monitor=False,
                       node_ip_address="127.0.0.1")  # fmt: skip
    params.dashboard_agent_listen_port = None
    node = ray._private.node.Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
    print(json.dumps({"raylet": node.all_processes["raylet"][0].process.pid}), flush=True)


if __name__ == "__main__":
    os.environ.update(NODE_ENV)
    _head() if sys.argv[1] == "head" else _worker(sys.argv[2])
    while True:
        time.sleep(3600)
