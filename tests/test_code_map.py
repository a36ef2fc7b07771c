"""docs/internals.md's code map read against the tree: every module of every package is named there, and every path
the map names exists; and every file of the code that the README, the docs or the code's own docstrings cite by path
(`service/engine/feeds.py`) or run as a module (`python -m bench.load`) exists. The map drifted before: bench/'s
modules left out, benchmarks named that live in training/probes/, a docstring citing a module that was never
written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ["service", "model_export", "training", "bench", "client/elmo_client"]  # what the map must name whole
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# A path into the code, not one inside another (build/bench/..., allennlp's own tests/...): after a space, a quote,
# a backquote or a parenthesis.
CITED = re.compile(r"(?<![\w/.-])((?:service|model_export|training|bench|client|scripts)/[\w/]*\w\.py)\b")
RUN = re.compile(r"python -m ((?:service|model_export|training|bench)(?:\.[a-z_][a-z0-9_]*)+)")


def code_map() -> dict[str, str]:
    """The map's entries: each path (`service/engine/`, `service/settings.py`) and its text, continuation lines
    included. An entry starts at column 0 (a top folder or file) or 2 (one inside the top folder above it)."""
    text = (REPO / "docs" / "internals.md").read_text()
    block = text.split("## The code map", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    entries: dict[str, str] = {}
    top = current = ""
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip())
        if not line.strip():
            continue
        if indent <= 2:
            name, _, rest = line.strip().partition(" ")
            current = name if indent == 0 else top + name
            if indent == 0:
                top = name
            entries[current] = rest
        else:
            entries[current] += " " + line.strip()
    return entries


def modules() -> list[str]:
    """Every module of every package (`__init__.py` aside), as a path from the repository's root."""
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if path.name != "__init__.py" and (path.parent / "__init__.py").exists():
                found.append(path.relative_to(REPO).as_posix())
    return found


def named_in(entry: str, text: str) -> set[str]:
    """The files an entry's text names (`session.py`, `probes/senses.py`, `manylangs_*.py`), as paths under it."""
    return {entry + name for name in re.findall(r"(?<![\w/.-])([\w/*]*\w\.py)\b", text)}


def test_the_map_parses_into_the_tree_s_folders():
    entries = code_map()
    assert {"service/", "service/engine/", "service/settings.py", "model_export/", "bench/", "tests/"} <= set(entries)
    assert len(entries) > 30


@pytest.mark.parametrize("module", modules())
def test_every_module_of_every_package_is_named_in_the_map(module):
    entries = code_map()
    if module in entries:
        return
    # the deepest folder of the map holding it names it: by its name, or its path from there (probes/senses.py)
    folder = max((e for e in entries if e.endswith("/") and module.startswith(e)), key=len, default=None)
    assert folder is not None, f"{module}: no folder of docs/internals.md's code map holds it"
    text, names = entries[folder], named_in(folder, entries[folder])
    below = module[len(folder) :]  # a module of a folder inside the entry's: its name beside that folder's
    inner = "/" in below and below.rsplit("/", 1)[0] + "/" in text and folder + Path(module).name in names
    assert module in names or inner or any(Path(module).match(name) for name in names if "*" in name), (
        f"{module} is not named in docs/internals.md's code map (under {folder}): name it there, with what it does"
    )


def test_every_path_the_map_names_exists():
    missing = []
    for entry, text in code_map().items():
        if not (REPO / entry).exists():
            missing.append(entry)
        if entry.endswith("/"):
            # by its path from the entry's folder, or from a folder inside it (client/: elmo_client/'s client.py)
            missing += [name for name in named_in(entry, text) if not any((REPO / entry).rglob(name[len(entry) :]))]
    assert missing == [], f"docs/internals.md's code map names what is not in the tree: {missing}"


def cited() -> list[tuple[str, str]]:
    """(where, path) for every file of the code cited by path, and every module run with `python -m` (its dotted
    name as a path, without .py), in the README, the docs and the code's own .py files."""
    sources = DOCS + [path for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))]
    found = []
    for source in sources:
        text = source.read_text()
        where = source.relative_to(REPO).as_posix()
        found += [(where, path) for path in CITED.findall(text)]
        found += [(where, name.replace(".", "/")) for name in RUN.findall(text)]  # a module or a package
    return found


def test_every_file_the_docs_and_docstrings_cite_exists():
    citations = cited()
    assert len(citations) > 100  # the scan reads what it should
    missing = sorted({f"{where}: {path}" for where, path in citations if not _exists(path)})
    assert missing == [], missing


def _exists(path: str) -> bool:
    """A file cited by path; a module run with `python -m` (no .py): its file, or its package's __main__.py."""
    if path.endswith(".py"):
        return (REPO / path).exists()
    return (REPO / f"{path}.py").exists() or (REPO / path / "__main__.py").exists()
