"""elmo-embed --engine ray on a real Ray cluster on this machine (tests/ray_cluster.py: a head and a worker node, each a
process group of its own, 1 CPU each, everything on 127.0.0.1), with the embedded default model: the same file as
the local run, Parquet that pandas and DuckDB read, a killed actor, a killed worker node, a killed driver resumed,
and bad lines. Each run is a real `elmo-embed` process, the driver, connected to the cluster by its address."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.ray_cluster import NODE_ENV, Node, RayCluster, alive, command, descendants

try:  # the ray extra and the dev tools: `make install` installs both, and CI runs these tests (CI set)
    import duckdb
    import pandas
    import ray  # noqa: F401
except ImportError as err:
    if os.environ.get("CI"):
        raise
    pytest.skip(f"--engine ray's tests need the ray extra and duckdb (make install): {err}", allow_module_level=True)

LINES = 800  # about 7 s of the default model's work on the two 1-CPU nodes: long enough to kill things mid-run
PART = 50


def corpus(path: Path, sentences: list[list[str]], lines: int = LINES, bad: int | None = None) -> Path:
    """`lines` lines of the fixture's sentences, each made distinct by a number, a blank line at index `bad`."""
    text = [("" if i == bad else " ".join([*sentences[i % len(sentences)], f"n{i}"])) for i in range(lines)]
    path.write_text("\n".join(text) + "\n")
    return path


def elmo_embed(*args, address: str | None = None, wait: bool = True, **popen):
    """A real elmo-embed process (the driver), on the cluster at `address`: finished, or started (wait=False)."""
    cmd = [sys.executable, "-m", "service.cli", "--no-progress", *map(str, args)]
    if address is not None:
        cmd += ["--engine", "ray", "--address", address, "--threads", "1", "--part-lines", str(PART)]
    env = {**os.environ, **NODE_ENV}  # the driver's own address on the loopback too
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True, **popen)  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    made = RayCluster(tmp_path_factory.mktemp("ray"), workers=1)
    yield made
    started = [pid for node in made.nodes() for pid in [node.proc.pid, *descendants(node.proc.pid)]]
    made.kill()
    assert not [pid for pid in started if alive(pid)]  # every Ray process is gone


@pytest.fixture(scope="module")
def local(tmp_path_factory, sentences):
    """The corpus and the local run's output, the answer every Ray run must equal."""
    folder = tmp_path_factory.mktemp("local")
    source = corpus(folder / "in.txt", sentences)
    run = elmo_embed(source, folder / "local.hdf5")
    assert run.returncode == 0, run.stderr
    return source, folder / "local.hdf5"


def assert_same_file(got: Path, want: Path, skipped: tuple[str, ...] = ()) -> None:
    """Dataset for dataset, bit for bit: keys, shapes, dtype, values, and sentence_to_index's text."""
    with h5py.File(got, "r") as g, h5py.File(want, "r") as w:
        names = sorted(set(w) - set(skipped))
        assert sorted(g) == names
        for name in names:
            assert g[name].dtype == w[name].dtype and g[name].shape == w[name].shape, name
            if name != "sentence_to_index":
                assert np.array_equal(g[name][...], w[name][...]), name
        if not skipped:
            assert g["sentence_to_index"][0] == w["sentence_to_index"][0]
        assert g.attrs["elmo_embed"] == w.attrs["elmo_embed"]


def wait_for(predicate, seconds: float = 120):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if found := predicate():
            return found
        time.sleep(0.05)
    raise AssertionError("waited in vain")


def test_the_ray_run_writes_the_local_runs_file_on_both_nodes(cluster, local, tmp_path):
    source, want = local
    run = elmo_embed(source, tmp_path / "ray.hdf5", address=cluster.address)
    assert run.returncode == 0, run.stderr
    assert f"embedded {LINES} sentences" in run.stderr
    assert "16 parts (0 written before), 2 actors on 2 nodes (127.0.0.1)" in run.stderr  # both took parts
    assert_same_file(tmp_path / "ray.hdf5", want)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ray.hdf5"]  # the parts' folder is gone


def test_parquet_that_pandas_and_duckdb_read_equals_the_hdf5(cluster, local, tmp_path, sentences):
    source, want = local
    out = tmp_path / "vectors"
    run = elmo_embed(source, out, "--format", "parquet", address=cluster.address)
    assert run.returncode == 0, run.stderr
    frame = pandas.read_parquet(out).sort_values("line")
    assert list(frame["line"]) == list(range(LINES))
    with h5py.File(want, "r") as w:
        for row in frame.iloc[::97].itertuples():
            layers = np.stack([np.stack(getattr(row, f"layer_{j}")) for j in range(3)])
            assert layers.dtype == np.float32 and np.array_equal(layers, w[str(row.line)][...])
        sentence = " ".join([*sentences[5], "n5"])
        query = f"SELECT layer_2 FROM '{out}/*.parquet' WHERE sentence = ?"
        (vectors,) = duckdb.execute(query, [sentence]).fetchone()
        assert np.array_equal(np.array(vectors, np.float32), w["5"][2])


def actor_pids(node: Node) -> list[int]:
    """The Ray Data actors' processes of one node (their titles are Ray's, set for each actor; their parent is the
    node's raylet)."""
    return [pid for pid in descendants(node.proc.pid) if command(pid).startswith(b"ray::MapWorker")]


def test_an_actor_killed_mid_run_costs_a_retry_not_the_job(cluster, local, tmp_path):
    source, want = local
    driver = elmo_embed(source, tmp_path / "ray.hdf5", address=cluster.address, wait=False)
    parts = tmp_path / "ray.hdf5.parts"
    wait_for(lambda: len(list(parts.glob("part-*.hdf5"))) >= 2)  # mid-run: parts written, most not
    (pid, *_) = wait_for(lambda: actor_pids(cluster.head))
    os.kill(pid, signal.SIGKILL)
    _, stderr = driver.communicate(timeout=300)
    assert driver.returncode == 0, stderr
    assert not alive(pid)
    assert_same_file(tmp_path / "ray.hdf5", want)


def test_a_driver_killed_mid_run_is_resumed_redoing_only_the_parts_not_written(cluster, local, tmp_path):
    source, want = local
    out = tmp_path / "ray.hdf5"
    driver = elmo_embed(source, out, address=cluster.address, wait=False)
    parts = tmp_path / "ray.hdf5.parts"
    wait_for(lambda: len(list(parts.glob("part-*.hdf5"))) >= 4)
    os.killpg(driver.pid, signal.SIGKILL)
    driver.communicate()
    kept = {p.name: p.stat().st_ino for p in parts.glob("part-*.hdf5")}
    assert 4 <= len(kept) < 16 and not out.exists()

    again = elmo_embed(source, out, address=cluster.address)  # without --resume: refused, nothing lost
    assert again.returncode == 1 and "--resume continues it" in again.stderr
    assert {p.name: p.stat().st_ino for p in parts.glob("part-*.hdf5")} == kept

    resumed = elmo_embed(source, out, "--resume", address=cluster.address, wait=False)
    written = wait_for(lambda: {p.name: p.stat().st_ino for p in parts.glob("part-*.hdf5")} if parts.exists() else {})
    _, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr
    before = int(stderr.split(" parts (")[1].split(" written before")[0])
    assert before >= len(kept)  # every part written before was kept, none embedded again
    assert all(written.get(name, ino) == ino for name, ino in kept.items())
    assert_same_file(out, want)


def test_a_bad_line_stops_the_job_naming_it_or_is_skipped_and_listed(cluster, local, tmp_path, sentences):
    _, want = local
    source = corpus(tmp_path / "in.txt", sentences, bad=567)
    run = elmo_embed(source, tmp_path / "ray.hdf5", address=cluster.address)
    assert run.returncode == 1 and f"{source}:568: empty sentence" in run.stderr
    assert "--resume --skip-bad-lines" in run.stderr  # the parts written are kept, and it says how to go on
    assert not (tmp_path / "ray.hdf5").exists()

    run = elmo_embed(source, tmp_path / "ray.hdf5", "--skip-bad-lines", "--resume", address=cluster.address)
    assert run.returncode == 0, run.stderr
    listed = [json.loads(line) for line in (tmp_path / "ray.hdf5.bad-lines.jsonl").read_text().splitlines()]
    assert listed == [{"file": str(source), "line_number": 568, "line": 567,
                       "reason": "empty sentence (remove the line, as allennlp asks)"}]  # fmt: skip
    assert_same_file(tmp_path / "ray.hdf5", want, skipped=("567",))


def test_a_worker_node_killed_mid_run_and_the_job_completes_on_the_head(cluster, local, tmp_path):
    source, want = local
    driver = elmo_embed(source, tmp_path / "ray.hdf5", address=cluster.address, wait=False)
    parts = tmp_path / "ray.hdf5.parts"
    wait_for(lambda: len(list(parts.glob("part-*.hdf5"))) >= 2)
    worker = cluster.workers.pop()
    worker.kill()  # the raylet, its object store and its actor: a machine lost
    _, stderr = driver.communicate(timeout=300)
    assert driver.returncode == 0, stderr
    assert_same_file(tmp_path / "ray.hdf5", want)


def test_without_an_address_a_local_ray_on_the_loopback_is_started_and_stopped(local, tmp_path):
    source, want = local
    cmd = [sys.executable, "-m", "service.cli", "--no-progress", "--engine", "ray", "--actors", "2", "--threads", "1",
           str(source), str(tmp_path / "ray.hdf5")]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False, start_new_session=True)
    assert run.returncode == 0, run.stderr
    assert "2 actors on 1 nodes (127.0.0.1)" in run.stderr  # its services on 127.0.0.1 alone
    assert_same_file(tmp_path / "ray.hdf5", want)
    too_many = subprocess.run([*cmd[:7], "3", *cmd[8:]], capture_output=True, text=True, timeout=300, check=False)
    assert too_many.returncode == 1 and "need more than the local Ray's 2 CPUs" in too_many.stderr
