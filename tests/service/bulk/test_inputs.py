"""elmo-embed's inputs (service/bulk/inputs.py): spans of whole lines that keep each line's index across files, read
exactly as the whole files are, bad lines named by file and line wherever their span starts."""

from __future__ import annotations

import random

import pytest

from service.bulk.inputs import InputError, Span, expand, read_sentences, split, whole_files


def lines_of(spans) -> list[tuple[int, list[str], str]]:
    return [(index, tokens, text) for index, tokens, text, _ in read_sentences(spans)]


def test_spans_keep_every_line_s_index_and_read_as_the_whole_files(tmp_path):
    rng = random.Random(0)
    for trial in range(40):
        paths, want = [], []
        for f in range(rng.randint(1, 3)):
            count = rng.randint(0, 9)
            words = [" ".join(rng.choices(["ab", "cd", "éf", "g\u00a0h"], k=rng.randint(1, 3))) for _ in range(count)]
            ending = "\n" if rng.random() < 0.5 else ""  # a last line without a newline counts too
            path = tmp_path / f"{trial}-{f}.txt"
            path.write_text("\n".join(words) + (ending if words else ""))
            paths.append(str(path))
            want += [w.strip() for w in words]
        spans = split(paths, rng.randint(1, 4))
        got = lines_of(spans)
        assert [index for index, *_ in got] == list(range(len(want)))
        assert [text for *_, text in got] == want
        assert sum(span.lines for span in spans) == len(want)
        assert lines_of(whole_files(paths)) == got


def test_a_part_never_holds_more_than_its_lines_and_counts_from_the_files_start(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("one\ntwo\nthree\n")
    b.write_text("four\nfive")
    spans = split([str(a), str(b)], 2)
    assert [(s.path, s.start, s.end, s.first_line, s.lines) for s in spans] == [
        (str(a), 0, 8, 0, 2),
        (str(a), 8, 14, 2, 1),
        (str(b), 0, 9, 3, 2),  # the last line has no newline
    ]
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert split([str(empty)], 3) == [] and lines_of(whole_files([str(empty)])) == []


def test_a_bad_line_is_named_by_its_file_and_line_in_any_span(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text('["a"]\n["b"]\n["c"]\nnot json\n["e"]\n')
    (first, second, third) = split([str(source)], 2)
    assert lines_of([first]) == [(0, ["a"], "a"), (1, ["b"], "b")]
    with pytest.raises(InputError, match=r"in\.jsonl:4: not JSON"):
        lines_of([second])
    skipped = []
    assert lines_of_skipping([second], skipped) == [(2, ["c"], "c")]
    assert skipped == [(str(source), 4, 3, "not JSON (Expecting value)")]
    assert lines_of([third]) == [(4, ["e"], "e")]


def lines_of_skipping(spans, skipped):
    return [(i, t, x) for i, t, x, _ in read_sentences(spans, on_bad=lambda *line: skipped.append(line))]


def test_globs_are_expanded_sorted_and_a_folder_or_nothing_refused(tmp_path):
    for name in ("b.txt", "a.txt", "c.jsonl"):
        (tmp_path / name).write_text("x\n")
    assert expand([str(tmp_path / "*.txt")]) == [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]
    with pytest.raises(FileNotFoundError, match="no such file"):
        expand([str(tmp_path / "*.tsv")])
    with pytest.raises(InputError, match="a folder"):
        expand([str(tmp_path)])
    assert Span(str(tmp_path / "a.txt")).size == 2
