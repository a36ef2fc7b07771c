"""A bulk job cut into parts: the parts' plan and manifest (what `--resume` reads), and the merge of hdf5 parts, or of
`--shard` outputs, into the one file a single run writes.

A part is a span of whole input lines (service/bulk/inputs.py), written by one engine into a file of its own under
the job's folder (`OUTPUT.parts/` for hdf5, the output folder itself for Parquet). A part file appears by a rename
once it is whole and on disk (service/bulk/pipeline.py), so a part file of the right name is a finished part; the
manifest names the job (inputs, model and flags) and every part's span, so a restarted run redoes only the parts
whose files are missing, and refuses to continue a job that is not the same. A lock on the folder keeps a second
run out while one runs.

Every elmo-embed output carries what made it (`about`: the model's manifest hash and the flags that change the
vectors, plus `shard` or `part`), as the hdf5 root attribute or Parquet metadata `elmo_embed`; `merge` refuses files
of different models or flags, naming them, and a set of shards that is not whole.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import h5py

from service.bulk.hdf5_writer import create_file
from service.bulk.inputs import InputError, Span, split
from service.bulk.pipeline import partial_name, refuse_output, replace_synced

MANIFEST = "_elmo_embed.json"  # a leading "_": pyarrow, pandas, Spark and DuckDB's globs skip it in a Parquet folder
PART_LINES = 4096  # lines a part at most: a unit of retry and of resume
PARTS_PER_ACTOR = 4  # at least this many parts an actor, so that a slow one does not hold the job's end


def about(model_dir: str | Path, **flags) -> str:
    """What makes an output's vectors: the model (its manifest's hash) and the flags given, as sorted JSON."""
    model = hashlib.sha256((Path(model_dir) / "manifest.json").read_bytes()).hexdigest()[:16]
    return json.dumps({"model": model, **flags}, sort_keys=True)


@dataclass(frozen=True)
class Part:
    index: int
    span: Span

    def name(self, fmt: str) -> str:
        return f"part-{self.index:05d}.{'parquet' if fmt == 'parquet' else 'hdf5'}"


def part_lines(total_lines: int, actors: int, most: int = PART_LINES) -> int:
    """Lines a part: at most `most`, and few enough for every actor to get PARTS_PER_ACTOR parts."""
    return max(1, min(most, -(-total_lines // (actors * PARTS_PER_ACTOR))))


def job_folder(output: Path, fmt: str) -> Path:
    return output if fmt == "parquet" else output.with_name(output.name + ".parts")


class Job:
    """The parts of one run and their folder, locked while this run holds it (a context manager)."""

    def __init__(self, output: Path, fmt: str, inputs: Sequence[str], stamp: str, lines: int, resume: bool):
        self.output, self.format, self.stamp = output, fmt, stamp
        self.folder = job_folder(output, fmt)
        refuse(output, fmt)
        self.folder.mkdir(exist_ok=True)
        self._lock = open(self.folder / ".lock", "a+")  # noqa: SIM115 (held until close)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise InputError(f"{self.folder}: another elmo-embed is writing this output now") from None
        described = {"format": fmt, "about": stamp, "inputs": [_described(path) for path in inputs]}
        manifest = self.folder / MANIFEST
        if manifest.is_file():
            found = json.loads(manifest.read_text())
            if resume:
                if differs := [key for key in described if found["job"].get(key) != described[key]]:
                    self.close()
                    raise InputError(f"--resume: {self.folder} is a run of other {', '.join(differs)}: give the same "
                                     "inputs, model and flags, or remove the folder to start over")  # fmt: skip
                self.parts = [Part(p["index"], Span(**p["span"])) for p in found["parts"]]
                self._sweep(keep=True)
                return
            if not found.get("finished"):
                self.close()
                raise InputError(f"{self.folder} holds a run that did not finish: --resume continues it (the same "
                                 "inputs, model and flags), or remove the folder to start over")  # fmt: skip
        self._sweep(keep=False)
        self.parts = [Part(i, span) for i, span in enumerate(split(inputs, lines))]
        self._write_manifest({"job": described, "parts": [{"index": p.index, "span": asdict(p.span)}
                                                          for p in self.parts]})  # fmt: skip

    def path(self, part: Part) -> Path:
        return self.folder / part.name(self.format)

    def todo(self) -> list[Part]:
        """The parts whose files are not yet written (a part file appears only whole)."""
        return [part for part in self.parts if not self.path(part).is_file()]

    def finish(self) -> None:
        """The parts made one output: for hdf5 the merged file, and the folder gone; for Parquet the folder, marked
        finished (a run of the same command replaces it)."""
        if self.format == "hdf5":
            merge([self.path(part) for part in self.parts], self.output, parts=True)
            for part in self.parts:
                self.path(part).unlink()
            (self.folder / MANIFEST).unlink()
            (self.folder / ".lock").unlink()
            self.close()
            self.folder.rmdir()
            return
        manifest = json.loads((self.folder / MANIFEST).read_text())
        self._write_manifest({**manifest, "finished": True})
        (self.folder / ".lock").unlink()

    def close(self) -> None:
        if not self._lock.closed:
            self._lock.close()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _sweep(self, keep: bool) -> None:
        """Remove what no finished part is: half-written files of a run that was killed, and (starting over) the
        parts of an earlier run."""
        for path in self.folder.iterdir():
            half = path.name.endswith(".partial")  # a part's or the manifest's, whose writer was killed
            if half or (not keep and path.name.startswith("part-") and path.suffix in (".hdf5", ".parquet")):
                path.unlink()

    def _write_manifest(self, manifest: dict) -> None:
        partial = partial_name(self.folder / MANIFEST)
        with open(partial, "x") as f:
            json.dump(manifest, f, indent=1)
        replace_synced(partial, self.folder / MANIFEST)


def refuse(output: Path, fmt: str) -> None:
    """Refuse, before any work, an output path that a run of `fmt` cannot write."""
    if fmt == "hdf5":
        return refuse_output(output)
    # a Parquet output is a folder: refuse a file there, or a folder that is not an elmo-embed output's
    if output.exists() and not output.is_dir():
        raise InputError(f"{output}: a file; --format parquet writes a folder of part files: give a folder's path")
    if output.is_dir() and not (output / MANIFEST).is_file() and any(output.iterdir()):
        raise InputError(f"{output}: a folder that holds other files; give a new or empty folder for the Parquet parts")


def _described(path: str) -> dict:
    stat = os.stat(path)
    return {"path": os.path.abspath(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def merge(paths: Sequence[str | Path], output: str | Path, parts: bool = False) -> dict:
    """The hdf5 outputs of elmo-embed's `--shard` runs (or a Ray run's parts) as one file, the file one run writes:
    every dataset copied as it is, sentence_to_index joined (a sentence seen in several keeps its last line).
    Refuses files of different models or flags, a set of shards that is not whole, or a line (or, with sentence
    keys, a sentence) in two files, naming them. Returns counts."""
    output = Path(output)
    refuse_output(output)
    if twice := next((path for i, path in enumerate(paths) if str(path) in map(str, paths[:i])), None):
        raise InputError(f"{twice} given twice")
    stamps = {str(path): _stamp(path) for path in paths}
    common = _common(stamps, "part" if parts else "shard")
    partial = partial_name(output)
    seen: dict[str, str] = {}
    index: dict[str, str] = {}
    has_index = False
    try:
        with create_file(partial) as out:
            for path in _in_line_order(paths, stamps):
                with h5py.File(path, "r") as part:
                    for name in _datasets(part):
                        if name in seen:
                            what = "sentence" if common.get("sentence_keys") else "line"
                            raise InputError(f"{what} {name!r} is in both {seen[name]} and {path}")
                        seen[name] = str(path)
                        part.copy(part[name], out, name)
                    if "sentence_to_index" in part:
                        has_index = True
                        for text, line in json.loads(part["sentence_to_index"][0]).items():
                            if int(line) >= int(index.get(text, -1)):
                                index[text] = line
            if has_index:
                dataset = out.create_dataset("sentence_to_index", (1,), dtype=h5py.string_dtype())
                dataset[0] = json.dumps(_first_seen_order(index, paths, stamps))
            out.attrs["elmo_embed"] = json.dumps(common, sort_keys=True)
        replace_synced(partial, output)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return {"files": len(stamps), "datasets": len(seen)}


def _stamp(path: str | Path) -> dict:
    try:
        with h5py.File(path, "r") as f:
            text = f.attrs.get("elmo_embed")
    except OSError as err:
        raise InputError(f"{path}: not an hdf5 file ({err})") from None
    if text is None:
        raise InputError(f"{path}: not written by elmo-embed (no elmo_embed attribute naming its model and flags)")
    return json.loads(text)


def _common(stamps: dict[str, dict], apart: str) -> dict:
    """What every file shares (all but `apart`, the shard or part), or InputError naming the files that differ."""
    first, *_ = stamps
    common = {k: v for k, v in stamps[first].items() if k not in ("shard", "part")}
    for path, stamp in stamps.items():
        mine = {k: v for k, v in stamp.items() if k not in ("shard", "part")}
        if mine != common:
            fields = sorted(k for k in common.keys() | mine.keys() if common.get(k) != mine.get(k))
            kind = "models or flags" if "model" in fields else "flags"
            raise InputError(f"{path} and {first} differ in {', '.join(fields)}: embedded with other {kind}; "
                             "merge only one job's files")  # fmt: skip
    if apart == "shard":
        _whole_shards(stamps)
    return common


def _whole_shards(stamps: dict[str, dict]) -> None:
    shards = {path: stamp.get("shard", "0/1") for path, stamp in stamps.items()}
    counts = {shard.split("/")[1] for shard in shards.values()}
    if len(counts) > 1:
        raise InputError(f"shards of different counts ({', '.join(sorted(counts))}): {shards}")
    count = int(counts.pop())
    by_index: dict[int, str] = {}
    for path, shard in shards.items():
        i = int(shard.split("/")[0])
        if i in by_index:
            raise InputError(f"shard {shard} twice: {by_index[i]} and {path}")
        by_index[i] = path
    if missing := sorted(set(range(count)) - set(by_index)):
        raise InputError(f"shards {', '.join(f'{i}/{count}' for i in missing)} missing: merge all {count} parts")


def _in_line_order(paths: Sequence[str | Path], stamps: dict[str, dict]) -> list[str | Path]:
    key = "part" if all("part" in s for s in stamps.values()) else "shard"
    return sorted(paths, key=lambda p: int(str(stamps[str(p)].get(key, "0/1")).split("/")[0]))


def _first_seen_order(index: dict[str, str], paths, stamps) -> dict[str, str]:
    """sentence_to_index in the order one run writes it (each sentence where its first line put it): parts hold
    contiguous lines, so their own order is that; shards interleave, so the sentences go by their lines."""
    if all("part" in s for s in stamps.values()):
        return index
    return dict(sorted(index.items(), key=lambda item: int(item[1])))


def _datasets(part: h5py.File) -> Iterator[str]:
    """Every dataset's path but sentence_to_index (with sentence keys, a "/" in a sentence makes groups)."""
    names: list[str] = []
    part.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    yield from (name for name in names if name != "sentence_to_index")
