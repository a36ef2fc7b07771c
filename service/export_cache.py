"""elmo-embed's cache of exports: allennlp's `--options-file`/`--weight-file` exported once by elmo-export into a
folder of the cache (ELMO_CACHE_DIR, else ~/.cache/elmo-service/allennlp), named by the hash of both files and
the graph version, and found there the next time.

What the folder's name promises is checked before it is used, as elmo-serve checks a model folder: its manifest
names the very files it was made from (the `sources` elmo-export records, their sha256), the graph version this
engine feeds, and a sha256 for every file, which each file has; and it holds its canaries (elmo-embed then runs
them, refusing a mismatch). A folder that does not (half written by a killed run, another model's export put
there, a file changed) is exported again, and one that still does not after that is refused: never used.

Runs started together (`--shard i/N` jobs on one fresh cache) take turns on a lock file per folder: the first
exports, the others wait and use the finished folder. Only the lock holder writes, so whatever `<name>.partial-*`
it finds was left by a run that died, and is removed. The elmo-export child dies with its parent."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from service.manifest import GRAPH_VERSION, MANIFEST, read_manifest, verify_files

PR_SET_PDEATHSIG = 1  # linux/prctl.h


class ExportRefused(RuntimeError):
    """The cache holds no usable export of these files, and exporting them again did not make one."""


def cache_dir() -> Path:
    return Path(os.environ.get("ELMO_CACHE_DIR") or Path.home() / ".cache" / "elmo-service" / "allennlp")


def exported_model(options_file: str, weight_file: str) -> Path:
    """The cache's folder for these model files, verified; exported first if it is missing or not what its name
    says. FileNotFoundError for files that are not local; ExportRefused when no export of them can be used."""
    for given in (options_file, weight_file):
        if "://" in given:
            raise FileNotFoundError(
                f"{given}: elmo-embed reads local files only: download it, or export the "
                "model once with elmo-export and pass --model"
            )
        if not Path(given).is_file():
            raise FileNotFoundError(f"file {given} not found")  # allennlp's cached_path's words
    name, sums = inputs_hash(Path(options_file), Path(weight_file))
    cache = cache_dir()
    folder = cache / name
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache / f"{name}.lock"):
        for stale in cache.glob(f"{name}.partial-*"):  # the lock holder alone writes these: a dead run's
            shutil.rmtree(stale, ignore_errors=True)
        if (problem := unusable(folder, sums)) is None:
            return folder
        if folder.exists() or folder.is_symlink():
            print(f"elmo-embed: {folder} is not a usable export of these files ({problem}): exporting again",
                  file=sys.stderr)  # fmt: skip
        _export(Path(options_file), Path(weight_file), folder)
        if (problem := unusable(folder, sums)) is not None:
            raise ExportRefused(f"{folder}: the export of {options_file} and {weight_file} is not usable: {problem}")
    return folder


def inputs_hash(options: Path, weights: Path) -> tuple[str, dict[str, str]]:
    """The folder's name (the graph version and both files' bytes, hashed) and each file's sha256 (what the
    manifest's `sources` must record), in one read of each file."""
    digest = hashlib.sha256(f"graph {GRAPH_VERSION}".encode())
    sums = {}
    for kind, path in (("options", options), ("weights", weights)):
        own = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
                own.update(block)
        sums[kind] = own.hexdigest()
    return digest.hexdigest()[:16], sums


def unusable(folder: Path, sums: dict[str, str]) -> str | None:
    """Why `folder` is not an export of the files whose sha256 are `sums` that this engine can run, if it is not."""
    if folder.is_symlink() or not folder.is_dir():
        return "not a folder" if folder.exists() or folder.is_symlink() else "missing"
    try:
        info = read_manifest(folder)
    except (FileNotFoundError, ValueError) as err:
        return str(err)
    manifest = info.manifest
    if manifest.get("graph_version") != GRAPH_VERSION:
        return f"graph version {manifest.get('graph_version')}, and this engine's is {GRAPH_VERSION}"
    sources = manifest.get("sources") if isinstance(manifest.get("sources"), dict) else {}
    for kind, want in sums.items():
        got = sources[kind].get("sha256") if isinstance(sources.get(kind), dict) else None
        if got != want:
            return f"made from other {kind} (sha256 {got}, and the file given is {want})"
    if not manifest.get("canaries"):
        return f"{folder / MANIFEST} names no canaries (elmo-export writes them)"
    try:
        for graph in info.graphs:
            verify_files(info, graph)
    except (OSError, ValueError) as err:
        return str(err)
    return None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` for the block: released by the kernel when the process dies, however."""
    with open(path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"elmo-embed: waiting for another run's export into {path.with_suffix('')}", file=sys.stderr)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _export(options: Path, weights: Path, folder: Path) -> None:
    """elmo-export into `<folder>.partial-PID/` (its own temporary folder inside it too), then renamed into
    place: a folder of the name is whole or absent, and what a killed run leaves is under a name the next one
    removes."""
    export = shutil.which("elmo-export", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if export is None:
        raise FileNotFoundError(
            "--options-file/--weight-file are exported by elmo-export, not installed here "
            "(pip install 'elmo-service[export]'): or export elsewhere and pass --model"
        )
    print(f"elmo-embed: exporting {options} and {weights} once into {folder}", file=sys.stderr)
    work = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    work.mkdir()
    try:
        done = subprocess.run(
            [export, "--options", str(options), "--weights", str(weights), "--out", str(work / "export")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=_dies_with(os.getpid()),
        )
        if done.returncode != 0:
            raise ExportRefused(f"elmo-export failed on {options} and {weights}: {done.stderr.strip()[-2000:]}")
        if folder.is_symlink() or folder.is_file():
            folder.unlink()
        elif folder.exists():  # what was there is not usable (checked under the lock): out of the way first
            folder.rename(work / "old")
        os.replace(work / "export", folder)
        _fsync_dir(folder.parent)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _dies_with(parent: int):
    """A preexec_fn: the child gets SIGKILL when its parent dies (Linux's PR_SET_PDEATHSIG), and ends at once if
    the parent died before it was set. Elsewhere, nothing."""

    def arrange() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:
            os._exit(1)

    return arrange


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
