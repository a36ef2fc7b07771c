"""elmo-embed --options-file/--weight-file's export cache (service/export_cache.py), with real elmo-embed and
elmo-export processes on a real ELMO_CACHE_DIR: runs started together all succeed on one export; a half folder,
a dead run's partial, another model's export or a changed file under the folder's name is never used (exported
again); the export child dies with its parent."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest

from service.export_cache import inputs_hash
from service.settings import DEFAULT_MODEL_DIR
from tests.conftest import TINY

FILES = ["--options-file", str(TINY / "options.json"), "--weight-file", str(TINY / "lm_weights.hdf5")]
NAME = inputs_hash(TINY / "options.json", TINY / "lm_weights.hdf5")[0]


def _embed(tmp_path: Path, cache: Path, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELMO_")} | {"ELMO_CACHE_DIR": str(cache)}
    return subprocess.Popen(
        [sys.executable, "-m", "service.cli", str(tmp_path / "in.txt"), *args, *FILES, "--threads", "1",
         "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def _run(tmp_path: Path, cache: Path, out: str = "out.hdf5", *args: str) -> tuple[int, str]:
    proc = _embed(tmp_path, cache, str(tmp_path / out), *args)
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


def _width(path: Path, line: int = 0) -> int:
    with h5py.File(path, "r") as f:
        return f[str(line)].shape[-1]


def _leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.name not in (NAME, f"{NAME}.lock"))


@pytest.fixture
def text(tmp_path) -> Path:
    (tmp_path / "in.txt").write_text("the first line .\nand a second one\nthird\n")
    return tmp_path / "in.txt"


def test_three_runs_started_together_on_a_fresh_cache_all_succeed_with_one_export(tmp_path, text):
    cache = tmp_path / "cache"
    procs = [_embed(tmp_path, cache, str(tmp_path / f"out{i}.hdf5"), "--shard", f"{i}/3") for i in range(3)]
    done = [(proc.wait(timeout=300), proc.stderr.read()) for proc in procs]
    errs = "\n".join(err for _, err in done)
    assert [code for code, _ in done] == [0, 0, 0], errs
    assert errs.count("exporting") == 1, errs  # one export, the others waited for it
    assert _leftovers(cache) == [], errs  # no .partial-PID holding a whole export
    assert [_width(tmp_path / f"out{i}.hdf5", line=i) for i in range(3)] == [32, 32, 32]  # shard i: line i


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def _exporting(pid: int) -> list[int]:
    """The children of `pid` that run elmo-export (elmo-embed may run others a moment: `uname -p` at an import)."""
    found = []
    for child in _children(pid):
        try:
            if "elmo-export" in Path(f"/proc/{child}/cmdline").read_text():
                found.append(child)
        except FileNotFoundError:  # gone already
            pass
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_a_killed_run_takes_its_export_with_it_and_the_next_run_recovers(tmp_path, text):
    cache = tmp_path / "cache"
    proc = _embed(tmp_path, cache, str(tmp_path / "out.hdf5"))
    deadline = time.monotonic() + 60
    while not (children := _exporting(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert children, "elmo-export never started"
    (child,) = children  # one export
    time.sleep(1)  # well into its export
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "elmo-export outlived the elmo-embed that started it"
    assert [p.name for p in cache.glob(f"{NAME}.partial-*")] == [f"{NAME}.partial-{proc.pid}"]
    # and a folder of the name without a manifest (a copy cut short, an older elmo-embed's): both recovered
    (cache / NAME).mkdir()
    (cache / NAME / "model.onnx").write_bytes(b"half")
    code, err = _run(tmp_path, cache)
    assert code == 0, err
    assert "not a usable export" in err and "manifest.json not found" in err, err
    assert _leftovers(cache) == [] and (cache / NAME / "manifest.json").is_file()
    assert _width(tmp_path / "out.hdf5") == 32


def _planted(cache: Path, source: Path) -> Path:
    cache.mkdir()
    shutil.copytree(source, cache / NAME)
    return cache / NAME / "manifest.json"


def test_a_verified_export_in_the_cache_is_used_without_exporting(tmp_path, text, tiny_model_dir):
    cache = tmp_path / "cache"
    _planted(cache, tiny_model_dir)  # the same files' export, made in this process
    code, err = _run(tmp_path, cache)
    assert code == 0 and "exporting" not in err, err
    assert _width(tmp_path / "out.hdf5") == 32


def test_another_models_export_under_the_name_is_exported_again(tmp_path, text):
    cache = tmp_path / "cache"
    _planted(cache, DEFAULT_MODEL_DIR)  # 256 wide, made from other files
    code, err = _run(tmp_path, cache)
    assert code == 0, err
    assert "made from other options" in err and "exporting" in err, err
    assert _width(tmp_path / "out.hdf5") == 32  # was 256: the planted export was used
    assert _leftovers(cache) == []


def _without_sums(manifest: Path) -> None:
    data = json.loads(manifest.read_text())
    del data["files"]
    manifest.write_text(json.dumps(data))


def _flipped_without_canaries(manifest: Path) -> None:
    data = json.loads(manifest.read_text())
    del data["canaries"]
    manifest.write_text(json.dumps(data))
    graph = manifest.parent / "model.onnx"
    raw = bytearray(graph.read_bytes())
    raw[-100] ^= 0x01  # inside the weights' data
    graph.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "tamper, named",
    [(_without_sums, "records no sha256"), (_flipped_without_canaries, "names no canaries")],
    ids=["sums-removed", "canaries-removed-weights-flipped"],
)
def test_a_changed_export_in_the_cache_is_never_used(tmp_path, text, tiny_model_dir, tamper, named):
    cache = tmp_path / "cache"
    tamper(_planted(cache, tiny_model_dir))
    code, err = _run(tmp_path, cache)
    assert code == 0, err
    assert named in err and "exporting" in err, err  # was rc 0 with a warning, the changed files used
    manifest = json.loads((cache / NAME / "manifest.json").read_text())
    assert manifest["files"] and manifest["canaries"]
    assert _leftovers(cache) == []


def test_a_model_folder_without_its_sums_is_refused(tmp_path, text, tiny_model_dir):
    """--model: elmo-embed checks the sha256 of what it reads as elmo-serve does (it checked none)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    _without_sums(model / "manifest.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELMO_")}
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "--model", str(model), str(text), str(tmp_path / "out.hdf5"),
         "--threads", "1", "--no-progress"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1 and "records no sha256 of its files" in done.stderr, done.stderr
    assert not (tmp_path / "out.hdf5").exists()


@pytest.mark.parametrize(
    "sources, named",
    [(None, "made from other options"), ([], "made from other options"), ({"options": "x"}, "made from other options"),
     ({"options": {"sha256": "0" * 64}}, "made from other options (sha256 " + "0" * 64)],
    ids=["none", "a-list", "not-an-object", "another-file"],
)  # fmt: skip
def test_a_manifest_naming_other_sources_is_unusable(tmp_path, tiny_model_dir, sources, named):
    def change(manifest: dict) -> None:
        if sources is None:
            del manifest["sources"]
        else:
            manifest["sources"] = sources

    assert named in _unusable_once_changed(tmp_path, tiny_model_dir, change)


def test_an_export_cached_by_the_previous_graph_version_is_made_again(tmp_path, tiny_model_dir):
    """Version 11's exports are still served as model folders (READABLE_GRAPH_VERSIONS), but one cached before
    version 12 applies its int8 products' rows' scales in ONNX Runtime's one-thread pass, not in the step (the
    kernel's ElmoScaledCellStep): the cache makes it again, not reuse it."""
    from service.manifest import GRAPH_VERSION, READABLE_GRAPH_VERSIONS

    assert GRAPH_VERSION == 12 and 11 in READABLE_GRAPH_VERSIONS
    why = _unusable_once_changed(tmp_path, tiny_model_dir, lambda manifest: manifest.update(graph_version=11))
    assert why == "graph version 11, and this engine's is 12"


def _unusable_once_changed(tmp_path: Path, tiny_model_dir: Path, change) -> str | None:
    """Why the cache would not use the tiny model's export (usable as it is) once `change` has edited its
    manifest."""
    from service.export_cache import unusable

    folder = tmp_path / NAME
    shutil.copytree(tiny_model_dir, folder)
    sums = inputs_hash(TINY / "options.json", TINY / "lm_weights.hdf5")[1]
    assert unusable(folder, sums) is None  # the same files' export
    manifest = json.loads((folder / "manifest.json").read_text())
    change(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return unusable(folder, sums)
