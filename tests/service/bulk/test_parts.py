"""elmo-embed's parts, merge, stopping and resuming on this machine (real elmo-embed processes, the tiny model): shards
merged into the unsharded file, merges of other models, flags or a set that is not whole refused naming them; SIGTERM
and SIGINT ending a run with one line and nothing half-written; a stopped run of parts resumed; a link planted where
the output is written not followed; Parquet equal to hdf5."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from service.bulk import read_embeddings
from service.settings import DEFAULT_MODEL_DIR


def default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a shell's background job (CI's) passes SIGINT on ignored


def elmo_embed(model, *args, wait=True):
    cmd = [sys.executable, "-m", "service.cli", "--no-progress", "--model", str(model), *map(str, args)]
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=default_sigint)  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=300)


def merge(*args):
    cmd = [sys.executable, "-m", "service.cli", "merge", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=300)


@pytest.fixture
def source(tmp_path, sentences):
    path = tmp_path / "in.txt"
    path.write_text("".join(" ".join(s) + "\n" for s in sentences * 3))  # repeated sentences keep their last line
    return path


def same_datasets(a, b) -> bool:
    got, got_index = read_embeddings(a)
    want, want_index = read_embeddings(b)
    return (
        got_index == want_index
        and list(got) == list(want)
        and all(got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]) for k in want)
    )


def test_shards_merge_into_the_unsharded_file(tiny_model_dir, source, tmp_path):
    assert elmo_embed(tiny_model_dir, source, tmp_path / "all.hdf5").returncode == 0
    for i in range(3):
        run = elmo_embed(tiny_model_dir, "--shard", f"{i}/3", source, tmp_path / f"part-{i}.hdf5")
        assert run.returncode == 0, run.stderr
    done = merge(tmp_path / "part-*.hdf5", tmp_path / "merged.hdf5")
    assert done.returncode == 0, done.stderr
    assert "merged 3 files, 90 datasets" in done.stderr
    assert same_datasets(tmp_path / "merged.hdf5", tmp_path / "all.hdf5")

    missing = merge(tmp_path / "part-0.hdf5", tmp_path / "part-2.hdf5", tmp_path / "two.hdf5")
    assert missing.returncode == 1 and "shards 1/3 missing" in missing.stderr
    shutil.copy(tmp_path / "part-0.hdf5", tmp_path / "copy-0.hdf5")
    twice = merge(tmp_path / "part-*.hdf5", tmp_path / "copy-0.hdf5", tmp_path / "twice.hdf5")
    assert twice.returncode == 1 and "shard 0/3 twice" in twice.stderr
    same = merge(tmp_path / "part-0.hdf5", tmp_path / "part-0.hdf5", tmp_path / "twice.hdf5")
    assert same.returncode == 1 and "part-0.hdf5 given twice" in same.stderr
    assert not any(tmp_path.glob("two.hdf5*")) and not any(tmp_path.glob("twice.hdf5*"))


def test_merge_refuses_outputs_of_other_models_or_flags_naming_them(tiny_model_dir, source, tmp_path):
    runs = {"a": (tiny_model_dir, "--shard", "0/2"), "b": (tiny_model_dir, "--shard", "1/2", "--top"),
            "c": (DEFAULT_MODEL_DIR, "--shard", "1/2")}  # fmt: skip
    for name, (model, *flags) in runs.items():
        assert elmo_embed(model, *flags, source, tmp_path / f"{name}.hdf5").returncode == 0
    flags = merge(tmp_path / "a.hdf5", tmp_path / "b.hdf5", tmp_path / "out.hdf5")
    assert flags.returncode == 1 and "b.hdf5 and" in flags.stderr and "differ in layers" in flags.stderr
    model = merge(tmp_path / "a.hdf5", tmp_path / "c.hdf5", tmp_path / "out.hdf5")
    assert model.returncode == 1 and "differ in model" in model.stderr and "other models or flags" in model.stderr
    with h5py.File(tmp_path / "foreign.hdf5", "w") as f:
        f["0"] = np.zeros((3, 2, 4), np.float32)
    foreign = merge(tmp_path / "a.hdf5", tmp_path / "foreign.hdf5", tmp_path / "out.hdf5")
    assert foreign.returncode == 1 and "not written by elmo-embed" in foreign.stderr
    assert not (tmp_path / "out.hdf5").exists()


def wait_for(predicate, seconds=60):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if found := predicate():
            return found
        time.sleep(0.01)
    raise AssertionError("waited in vain")


@pytest.mark.parametrize(("sent", "status", "name"), [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "SIGINT")])
def test_a_signal_ends_the_run_with_one_line_and_leaves_nothing(tiny_model_dir, sentences, tmp_path, sent, status,
                                                                name):  # fmt: skip
    source = tmp_path / "in.txt"
    source.write_text("".join(" ".join(s) + f" n{i}\n" for i, s in enumerate(sentences * 200)))
    run = elmo_embed(tiny_model_dir, source, tmp_path / "out.hdf5", wait=False)
    wait_for(lambda: list(tmp_path.glob("out.hdf5.*.partial")))  # writing
    run.send_signal(sent)
    _, stderr = run.communicate(timeout=30)
    assert run.returncode == status
    assert stderr.strip().splitlines()[-1] == f"elmo-embed: stopped by {name}: nothing written"
    assert "Traceback" not in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


def test_a_stopped_run_of_parts_is_resumed_redoing_only_what_was_not_written(tiny_model_dir, sentences, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("".join(" ".join(s) + f" n{i}\n" for i, s in enumerate(sentences * 100)))  # 3,000 lines
    assert elmo_embed(tiny_model_dir, source, tmp_path / "plain.hdf5").returncode == 0
    run = elmo_embed(tiny_model_dir, "--resume", "--part-lines", "100", source, tmp_path / "out.hdf5", wait=False)
    parts = tmp_path / "out.hdf5.parts"
    wait_for(lambda: len(list(parts.glob("part-*.hdf5"))) >= 3)
    run.send_signal(signal.SIGTERM)
    _, stderr = run.communicate(timeout=30)
    assert run.returncode == 143 and "parts kept in" in stderr and "with --resume continues" in stderr
    kept = {p.name: p.stat().st_ino for p in parts.glob("part-*.hdf5")}
    assert 3 <= len(kept) < 30 and not list(parts.glob("*.partial"))

    changed = tmp_path / "other.txt"
    changed.write_text(source.read_text() + "one more line\n")
    assert elmo_embed(tiny_model_dir, "--resume", "--part-lines", "100", changed, tmp_path / "out.hdf5").returncode == 1

    resumed = elmo_embed(tiny_model_dir, "--resume", "--part-lines", "100", source, tmp_path / "out.hdf5")
    assert resumed.returncode == 0, resumed.stderr
    assert same_datasets(tmp_path / "out.hdf5", tmp_path / "plain.hdf5")
    with h5py.File(tmp_path / "out.hdf5") as out, h5py.File(tmp_path / "plain.hdf5") as plain:
        assert out["sentence_to_index"][0] == plain["sentence_to_index"][0]  # the very same text, in line order
    assert not parts.exists()


def test_a_link_planted_at_the_partial_name_is_never_followed(tiny_model_dir, source, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "out.hdf5.partial").symlink_to(victim)  # the name elmo-embed once wrote to
    assert elmo_embed(tiny_model_dir, source, tmp_path / "out.hdf5").returncode == 0
    assert victim.read_text() == "precious"
    assert (tmp_path / "out.hdf5").is_file() and not (tmp_path / "out.hdf5").is_symlink()
    (tmp_path / "folder.hdf5").mkdir()
    refused = elmo_embed(tiny_model_dir, source, tmp_path / "folder.hdf5")
    assert refused.returncode == 1 and "a folder" in refused.stderr and "canaries" not in refused.stderr


def test_parquet_holds_the_same_vectors_as_hdf5_in_both_dtypes(tiny_model_dir, source, tmp_path):
    pandas = pytest.importorskip("pandas")
    for dtype in ("float32", "float16"):
        assert elmo_embed(tiny_model_dir, "--dtype", dtype, source, tmp_path / f"{dtype}.hdf5").returncode == 0
        run = elmo_embed(tiny_model_dir, "--dtype", dtype, "--format", "parquet", "--top", source, tmp_path / dtype)
        assert run.returncode == 0, run.stderr
        frame = pandas.read_parquet(tmp_path / dtype)
        got, index = read_embeddings(tmp_path / f"{dtype}.hdf5")
        assert sorted(frame["line"]) == list(range(90))
        for row in frame.itertuples():
            top = np.stack(row.top)
            assert top.dtype == np.dtype(dtype) and np.array_equal(top, got[row.line][-1])
            assert index[row.sentence] == str(max(i for i in range(90) if i % 30 == row.line % 30))
        assert json.loads(json.loads((tmp_path / dtype / "_elmo_embed.json").read_text())["job"]["about"])[
            "dtype"] == dtype  # fmt: skip
    assert not os.path.exists(tmp_path / "float32" / ".lock")


def test_what_a_killed_run_left_is_swept_and_nothing_a_live_one_writes(tiny_model_dir, source, tmp_path):
    import socket

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    stale = tmp_path / f"out.hdf5.{host}-{dead.stdout.strip()}-0123456789abcdef.partial"  # a SIGKILLed run's
    live = tmp_path / f"out.hdf5.{host}-{os.getpid()}-fedcba9876543210.partial"  # a run still writing (this one)
    other = tmp_path / f"out.hdf5.another-host-{dead.stdout.strip()}-0011223344556677.partial"  # on a shared volume
    for path in (stale, live, other):
        path.write_bytes(b"half")
    assert elmo_embed(tiny_model_dir, source, tmp_path / "out.hdf5").returncode == 0
    assert not stale.exists() and live.exists() and other.exists()
