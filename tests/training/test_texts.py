"""The sources' markup read into paragraphs and sentences (training.texts). Inline samples stand in for the
Debian packages, which a fresh clone need not have."""

from __future__ import annotations

from training.texts import (
    html_paragraphs,
    parse_gcide_entry,
    plain_paragraphs,
    pod_of_module,
    pod_paragraphs,
    rst_paragraphs,
    split_sentences,
)

GCIDE_ENTRY = r"""Feeler \Feel"er\, n.
   1. One who, or that which, feels.
      [1913 Webster]

   2. (Zool.) One of the sense organs or certain animals (as
      insects), which are used in testing objects by touch; an antenna. [R.]
      [1913 Webster]

            Insects . . . perpetually feeling and searching
            before them with their feelers or antenn[ae].
                                                  --Derham.
      [1913 Webster]

   3. a gloss copied from WordNet 1.5
      [WordNet 1.5]

   Syn: antenna; palp.
      [PJC]
"""


def test_gcide_entry_gives_definitions_and_quotations_without_markup():
    headword, texts = parse_gcide_entry(GCIDE_ENTRY.splitlines())
    assert headword == "feeler"
    assert texts == [
        "One who, or that which, feels.",
        "One of the sense organs or certain animals (as insects), which are used in testing objects by touch; "
        "an antenna.",
        "Insects . . . perpetually feeling and searching before them with their feelers or antennae.",
    ]


def test_gcide_etymology_on_the_headword_lines_is_dropped():
    entry = ["Benefit \\Ben\"e*fit\\, n. [OE. benefet, benfeet, F.", "   bienfait, fr. L. benefactum.]",
             "   1. An act of kindness; a favor conferred.", "      [1913 Webster]"]  # fmt: skip
    assert parse_gcide_entry(entry) == ("benefit", ["An act of kindness; a favor conferred."])


def test_sentences_are_cut_at_stops_but_not_after_abbreviations_or_initials():
    text = "Mr. Darcy came, e.g. on Monday. He saw J. Smith there!  Was it late? \u201cYes.\u201d The end"
    assert split_sentences(text) == [
        "Mr. Darcy came, e.g. on Monday.",
        "He saw J. Smith there!",
        "Was it late?",
        "\u201cYes.\u201d",
        "The end",
    ]


def test_rst_keeps_prose_and_drops_headings_code_and_tables():
    text = """Title
=====

The :ref:`driver <drv>` reads ``struct foo`` and *emphasis*, see `docs <http://x>`_.
It continues here as follows::

    int code(void);

.. code-block:: c

   more code;

.. note::

   A note is prose.

+---+---+
| a | b |
+---+---+

- A bullet item.
"""
    assert rst_paragraphs(text) == [
        "The driver reads struct foo and emphasis, see docs. It continues here as follows:",
        "A note is prose.",
        "A bullet item.",
    ]


def test_pod_keeps_ordinary_paragraphs_with_formatting_codes_as_text():
    pod = "=head1 NAME\n\nThe B<print> function, see L<perlfunc/print> and L<the docs|perlop>; E<lt>x E<gt>.\n\n"
    pod += "    verbatim code;\n\n=cut\n"
    assert pod_paragraphs(pod) == ["The print function, see print and the docs; <x >."]
    module = "package Foo;\nsub x {}\n=head1 DESCRIPTION\n\nFoo does things.\n\n=cut\n\nsub y {}\n"
    assert pod_paragraphs(pod_of_module(module)) == ["Foo does things."]


def test_plain_text_and_asciidoc_drop_headings_and_delimited_blocks():
    text = """NAME
----
git-foo - do a thing

DESCRIPTION
-----------
Run linkgit:git-commit[1] with `--amend` to change 'the' commit.

------------
$ git foo

and more
------------

--verbose::
	Say more.
"""
    assert plain_paragraphs(text) == [
        "git-foo - do a thing",
        "Run git-commit with --amend to change the commit.",
        "Say more.",  # a definition list's text, without its term
    ]


def test_html_paragraphs_without_pre_blocks():
    html = "<html><p>First <b>bold</b>\n paragraph.</p><pre><p>not this</p></pre><p>Second.</p></html>"
    assert html_paragraphs(html) == ["First bold paragraph.", "Second."]
