"""bench/hostile/'s runner without running an attack: every row is named by what it attacks (no round or issue
number), listed with what it does, and a row that is not there is refused by name before any server starts."""

from __future__ import annotations

import re

import pytest

from bench.hostile.__main__ import ROWS, main


def test_every_row_is_named_by_its_attack_and_listed(capsys):
    assert main(["--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == list(ROWS) and len(ROWS) == 23
    assert not [name for name in ROWS if re.search(r"\d|round|second|third|fourth|fifth|issue", name)]
    assert all(callable(measure) and title for title, measure in ROWS.values())


def test_an_unknown_row_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        main(["--rows", "parse,fifth"])
    assert "unknown rows ['fifth']" in capsys.readouterr().err
