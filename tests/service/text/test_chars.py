"""The published character mapping, checked against ids written out by hand from the bilm-tf rules."""

import numpy as np
import pytest

from service.text.chars import MAX_CHARS, char_key, sentence_char_ids, token_char_ids

BOW, EOW, PAD = 259, 260, 261  # 258, 259, 260 shifted by +1


def expected_row(payload: list[int]) -> list[int]:
    row = [BOW, *payload, EOW]
    return row + [PAD] * (MAX_CHARS - len(row))


def test_ascii_word():
    assert token_char_ids("ab").tolist() == expected_row([ord("a") + 1, ord("b") + 1])


def test_boundary_tokens_use_reserved_ids():
    assert token_char_ids("<S>").tolist() == expected_row([257])  # BOS 256 + 1
    assert token_char_ids("</S>").tolist() == expected_row([258])  # EOS 257 + 1
    assert token_char_ids("<s>").tolist() == expected_row([b + 1 for b in b"<s>"])  # only the exact spelling


@pytest.mark.parametrize("length", [0, 1, 47, 48, 49, 50, 51, 10_000])
def test_truncation_keeps_both_markers(length):
    row = token_char_ids("x" * length)
    kept = min(length, MAX_CHARS - 2)
    assert row.shape == (MAX_CHARS,) and row.dtype == np.int32
    assert row.tolist() == expected_row([ord("x") + 1] * kept)


def test_non_ascii_is_utf8_bytes():
    assert token_char_ids("é🙂").tolist() == expected_row([b + 1 for b in "é🙂".encode()])


def test_multibyte_truncation_cuts_bytes_not_characters():
    token = "a" + "é" * 30  # 61 bytes; the 48 kept end inside the 24th "é", as in the published mapping
    assert token_char_ids(token).tolist() == expected_row([b + 1 for b in token.encode()[:48]])


def test_control_characters_and_nul_are_bytes():
    assert token_char_ids("\x00\t\x7f").tolist() == expected_row([1, 10, 128])


def test_lone_surrogate_is_dropped_like_encode_ignore():
    assert token_char_ids("a\ud800b").tolist() == token_char_ids("ab").tolist()


def test_sentence_adds_boundaries():
    ids = sentence_char_ids(["Hi"])
    assert ids.shape == (3, MAX_CHARS)
    assert ids[0].tolist() == token_char_ids("<S>").tolist()
    assert ids[1].tolist() == token_char_ids("Hi").tolist()
    assert ids[2].tolist() == token_char_ids("</S>").tolist()
    assert (ids > 0).all()  # id 0 is reserved for batch padding


def test_char_key_is_what_the_ids_depend_on():
    assert char_key("<S>") == "<S>" and char_key("</S>") == "</S>"  # the boundaries' own ids
    assert char_key("<s>") == b"<s>"
    assert char_key("x" * 1_000_000) == char_key("x" * 48 + "y") == b"x" * 48
    assert char_key("a\ud800b") == b"ab"
    for token in ("x" * 1_000_000, "a" + "é" * 30, "<S>", "\x00"):
        other = token + "more" if len(char_key(token)) == MAX_CHARS - 2 else token
        assert token_char_ids(other).tolist() == token_char_ids(token).tolist()
