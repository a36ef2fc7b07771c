"""The examples of the README and of the docs run as pasted: every shell and Python block of the README's quick
start and of the pages that hold the service's examples (docs/api.md, with several models; docs/client.md, the
Python client, allennlp, OpenAI's clients and LangChain; docs/cli.md; docs/allennlp.md, the migration from allennlp),
against a real elmo-serve of the embedded default model, in a folder laid out as a checkout after `make serve`
(.venv/, service/embedded/default/). A block's id names its file and line (docs/api.md:line-42). Where a page
shows what a block prints (the JSON block after it), the output is compared with it: the same structure and keys,
strings and integers equal, and each number shown to k decimals within half a unit of its last digit; "[...]"
stands for any value, "..." at the end of an object for more keys, and "... N numbers" at the end of a list for the
rest of N.

A hidden comment before a block says what the test does beside running it, one directive a line:

    <!-- readme-test
    skip: why                   not run (a set-up step, a synopsis with placeholders, a download)
    setup: shell command        run first, in the block's folder (e.g. a file the block reads)
    env: NAME=value             in the block's environment
    server                      a server started in the background; the blocks after it in its section use it
    check: python expression    true after the block (in its namespace; after a shell block, in the block's folder
                                with json, h5py and numpy as np imported)
    ignore: 0.data.*.created    a value of the shown output that is not compared (N.key.key, * for any item)
    -->

The one thing changed in a block is the port: the examples' servers are on 127.0.0.1:8000, the test's on free ports.
Nothing is downloaded: a block that needs a model from elsewhere gets a stand-in that its comment names. A
readme-test comment in a file or section that does not run fails the test, as does a link of the README to a docs
page or heading that is not there (mkdocs build --strict checks the docs' own links)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.live_server import free_port, running_server, stop, wait_ready

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# The files whose blocks run, and in each the sections (## headings, "" before the first) whose blocks run, or None
# for all of them: the README's quick start, and the pages of the API (with several models), the clients and the CLI.
SOURCES: dict[str, tuple[str, ...] | None] = {
    "README.md": ("Quick start",),
    "docs/api.md": None,
    "docs/client.md": None,
    "docs/cli.md": None,
    "docs/allennlp.md": None,
}
BLOCK_S = 120


@dataclass
class Block:
    file: str  # README.md or docs/NAME.md, from the repository's root
    language: str  # sh or python
    code: str
    line: int  # where it starts in its file
    section: str  # its ### (or ##) heading
    directives: dict[str, list[str]] = field(default_factory=dict)
    shown: str | None = None  # the JSON block that follows it: what it prints

    @property
    def id(self) -> str:
        return f"{self.file}:line-{self.line}"


FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
COMMENT = re.compile(r"<!-- readme-test\n(.*?)-->\s*$", re.S)


def readme_blocks() -> list[Block]:
    return [block for name, sections in SOURCES.items() for block in file_blocks(name, sections)]


def file_blocks(name: str, sections: tuple[str, ...] | None) -> list[Block]:
    """The runnable blocks of one file, in the given ## sections (None: all)."""
    text = (ROOT / name).read_text()
    headings = [(m.start(), m[1], m[2].strip()) for m in re.finditer(r"^(##|###) (.+)$", text, re.M)]
    blocks: list[Block] = []
    end, last = 0, None
    for found in FENCE.finditer(text):
        between, end = text[end : found.start()], found.end()
        if found[1] == "json" and last is not None and not between.strip():
            last.shown = found[2]  # what the block just above prints
            continue
        last = None
        top = next((title for at, level, title in reversed(headings) if at < found.start() and level == "##"), "")
        section = next((title for at, _, title in reversed(headings) if at < found.start()), "")
        if found[1] in ("sh", "python") and (sections is None or top in sections):
            comment = COMMENT.search(between)
            line = text.count("\n", 0, found.start()) + 2
            directives = parse_directives(comment[1] if comment else "")
            blocks.append(last := Block(name, found[1], found[2], line, section, directives))
    return blocks


def parse_directives(comment: str) -> dict[str, list[str]]:
    directives: dict[str, list[str]] = {}
    for line in comment.splitlines():
        name, _, value = line.strip().partition(":")
        if name:
            directives.setdefault(name.strip(), []).append(value.strip())
    return directives


# -- what the README shows, against what a block printed -----------------------------------------------------------

ANY, MORE = "<any value>", "<more keys>"
REST = re.compile(r"\.\.\. (\d+) numbers")


def shown_values(shown: str) -> list:
    """The JSON values a README output block shows, its placeholders made markers."""
    text = shown.replace("[...]", json.dumps(ANY))
    text = re.sub(r",\s*\.\.\.\s*}", f', "{MORE}": true}}', text)
    return json_values(text)


def json_values(text: str) -> list:
    """Every JSON value in `text`, one after the other (curl prints answers without a newline between them)."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while (at := len(text) - len(text[at:].lstrip())) < len(text):
        value, at = decoder.raw_decode(text, at)
        values.append(value)
    return values


def decimals(number: float, shown: str) -> float:
    return 0.5 * 10.0 ** -len(shown.split(".")[1]) if "." in shown else 0.0


def compare(got, want, path: str, ignored: list[str], shown_numbers: dict) -> None:
    """`got` is what `want` (a value of shown_values) shows; raises AssertionError naming the path otherwise."""
    if any(re.fullmatch(pattern.replace(".", r"\.").replace("*", r"[^.]+"), path) for pattern in ignored):
        return
    if want == ANY:
        return
    if isinstance(want, dict):
        assert isinstance(got, dict), f"{path}: {got!r} is not an object"
        keys = set(want) - {MORE}
        assert keys <= set(got), f"{path}: keys {sorted(keys - set(got))} missing from {sorted(got)}"
        if MORE not in want:
            assert set(got) == keys, f"{path}: keys {sorted(set(got) - keys)} not shown"
        for key in keys:
            compare(got[key], want[key], f"{path}.{key}", ignored, shown_numbers)
    elif isinstance(want, list):
        assert isinstance(got, list), f"{path}: {got!r} is not a list"
        if want and isinstance(want[-1], str) and (rest := REST.fullmatch(want[-1])):
            assert len(got) == int(rest[1]), f"{path}: {len(got)} numbers, not {rest[1]}"
            want, got = want[:-1], got[: len(want) - 1]
        assert len(got) == len(want), f"{path}: {len(got)} items, not {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            compare(g, w, f"{path}.{i}", ignored, shown_numbers)
    elif isinstance(want, float):
        tolerance = decimals(want, shown_numbers.get(want, repr(want)))
        assert isinstance(got, (int, float)) and abs(got - want) <= tolerance + 1e-12, f"{path}: {got} is not {want}"
    else:
        assert got == want and type(got) is type(want), f"{path}: {got!r} is not {want!r}"


def numbers_as_shown(shown: str) -> dict[float, str]:
    """Each decimal number of the README's text, by its value: how many digits it shows."""
    return {float(m): m for m in re.findall(r"-?\d+\.\d+", shown)}


# -- running the blocks ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkout(tmp_path_factory, default_model_dir, manylangs_model_dir) -> Path:
    """A folder laid out as a checkout after `make serve`: .venv/ (this interpreter's) and the default model's
    export in service/embedded/default (a fresh one: tests/models/test_embedded_export.py holds the shipped one to
    it); where the blocks run."""
    folder = tmp_path_factory.mktemp("readme")
    (folder / ".venv").symlink_to(Path(sys.prefix))
    (folder / "build" / "models").mkdir(parents=True)
    (folder / "service" / "embedded").mkdir(parents=True)
    (folder / "service" / "embedded" / "default").symlink_to(default_model_dir)
    return folder


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    with running_server(default_model_dir, tmp_path_factory.mktemp("readme-server")) as s:
        yield s


@dataclass
class Servers:
    """The server each section's blocks talk to: the module's, or one that a `server` block of the section (of the
    same file) started."""

    default: int
    started: dict[tuple[str, str], tuple[int, subprocess.Popen]] = field(default_factory=dict)

    def port(self, block: Block) -> int:
        where = (block.file, block.section)
        return self.started[where][0] if where in self.started else self.default


@pytest.fixture(scope="module")
def servers(server):
    held = Servers(server.port)
    yield held
    for _, proc in held.started.values():
        assert stop(proc) == 0


def environment(block: Block, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELMO_")}
    for setting in block.directives.get("env", []):
        name, _, value = setting.partition("=")
        env[name] = on_port(value, port)
    return env


def on_port(text: str, port: int) -> str:
    return re.sub(r"(localhost|127\.0\.0\.1):8000\b", rf"\g<1>:{port}", text)


BLOCKS = readme_blocks()


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_block(block, checkout, servers, tmp_path):
    if "skip" in block.directives:
        assert block.directives["skip"][0], "a skipped block says why"
        pytest.skip(block.directives["skip"][0])
    port = servers.port(block)
    env = environment(block, port)
    for command in block.directives.get("setup", []):
        done = subprocess.run(command, shell=True, cwd=checkout, env={**env, "ROOT": str(ROOT)}, text=True,
                              capture_output=True, check=False)  # fmt: skip
        assert done.returncode == 0, f"setup {command!r}: {done.stderr}"
    code = on_port(block.code, port)
    if "server" in block.directives:  # started as pasted, in the background, on a port of its own
        own = free_port()
        log = tmp_path / "server.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(["bash", "-c", code], cwd=checkout, env={**env, "ELMO_PORT": str(own)},
                                    stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        servers.started[(block.file, block.section)] = (own, proc)
        wait_ready(proc, f"http://127.0.0.1:{own}", log)
        return
    if block.language == "python":
        checks = "".join(f"assert {c}, {c!r}\n" for c in block.directives.get("check", []))
        command = [sys.executable, "-c", code + checks]
    else:
        command = ["bash", "-e", "-o", "pipefail", "-c", code]
    done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True, timeout=BLOCK_S, check=False)
    assert done.returncode == 0, f"{block.file} line {block.line}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    if block.language == "sh":
        if checks := block.directives.get("check", []):  # in Python, in the block's folder, after it ran
            script = "import json, h5py, numpy as np\n" + "".join(f"assert {c}, {c!r}\n" for c in checks)
            after = subprocess.run([sys.executable, "-c", script], cwd=checkout, capture_output=True, text=True)
            assert after.returncode == 0, after.stderr[-2000:]
        printed = json_values(done.stdout) if done.stdout.strip().startswith(("{", "[")) else []
        for value in printed:  # an error answer is JSON too: curl -s does not fail on it
            assert not (isinstance(value, dict) and ({"detail", "error"} & set(value))), value
        if block.shown is not None:
            want = shown_values(block.shown)
            assert len(printed) == len(want), f"{len(printed)} answers printed, {len(want)} shown"
            numbers = numbers_as_shown(block.shown)
            for i, (got, shown) in enumerate(zip(printed, want, strict=True)):
                compare(got, shown, str(i), block.directives.get("ignore", []), numbers)


def test_the_docs_have_runnable_blocks_in_every_section_they_cover():
    sections = {(b.file, b.section) for b in BLOCKS if "skip" not in b.directives}
    assert {
        ("README.md", "Quick start"),
        ("docs/api.md", "`POST /embed`"),
        ("docs/api.md", "`POST /v1/embeddings` (OpenAI-style)"),
        ("docs/api.md", "`POST /tokenize`"),
        ("docs/api.md", "Several models"),
        ("docs/client.md", "Python client"),
        ("docs/client.md", "The allennlp adapter"),
        ("docs/client.md", "OpenAI's clients"),
        ("docs/client.md", "LangChain"),
        ("docs/cli.md", "`elmo-embed`: a file of sentences to hdf5"),
        ("docs/allennlp.md", "The `elmo` command"),
        ("docs/allennlp.md", "`ElmoEmbedder`"),
        ("docs/allennlp.md", "The `Elmo` module"),
    } <= sections
    assert all(b.shown is None or b.language == "sh" for b in BLOCKS)


def test_every_readme_test_comment_is_on_a_block_that_runs():
    # A block moved to a page or section that does not run would take its checks with it, silently.
    for path in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        name = path.relative_to(ROOT).as_posix()
        comments = FENCE.sub("", path.read_text()).count("<!-- readme-test")  # not those shown in a code block
        on_blocks = sum(1 for b in BLOCKS if b.file == name and b.directives)
        assert comments == on_blocks, f"{name}: {comments} readme-test comments, {on_blocks} on blocks that run"


def slug(title: str) -> str:
    """A heading's anchor, as mkdocs (Python-Markdown's toc) and GitHub make it for this project's headings."""
    text = unicodedata.normalize("NFKD", title.replace("`", "")).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def test_the_readme_links_to_docs_pages_and_headings_that_exist():
    # mkdocs build --strict checks the links between the docs' pages; the README is no page of the site.
    links = re.findall(r"\]\((docs/[^)#]+)(?:#([^)]+))?\)", (ROOT / "README.md").read_text())
    assert links
    for page, anchor in links:
        assert (ROOT / page).is_file(), page
        if anchor:
            text = re.sub(r"^```.*?^```$", "", (ROOT / page).read_text(), flags=re.M | re.S)
            anchors = {slug(m[1]) for m in re.finditer(r"^#{1,6} (.+?)\s*$", text, re.M)}
            assert anchor in anchors, f"{page}#{anchor}: no such heading"
