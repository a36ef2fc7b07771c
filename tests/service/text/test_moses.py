"""The Moses tokenizer for string requests, and the cheap lower bound that refuses oversized ones first."""

import time
from itertools import islice

from hypothesis import given, settings
from hypothesis import strategies as st

from service.text import moses
from service.text.moses import max_tokens, min_tokens, tokenize

# Words, punctuation Moses splits off, whitespace of every kind, and the control characters it deletes.
WORDS = ["the", "U.S.", "don't", "bio-identical", "42,000", "(x)", '"q"', "...", "'", "Mr.", "é", "🙂", "a.b."]
SPACES_AND_JUNK = [" ", "\t", "\n", "\x0b", "\x1c", "\x85", "\u2028", "\xa0", "\x00", "\x07", "\x1b", "\x7f"]
PIECES = st.sampled_from([*WORDS, *SPACES_AND_JUNK])


@settings(max_examples=300, deadline=None)
@given(st.lists(PIECES, max_size=30).map("".join) | st.text(max_size=60))
def test_min_tokens_is_a_lower_bound(text):
    assert min_tokens(text) <= len(tokenize(text))


def test_min_tokens_counts_words_without_the_junk_moses_deletes():
    assert min_tokens("a b\tc\n d") == 4
    assert min_tokens("\x00 \x01\x02 a\x00b") == 1  # only-junk words vanish; "a\x00b" is one word "ab"
    assert tokenize("\x00 \x01\x02 a\x00b") == ["ab"]
    assert min_tokens("") == min_tokens(" \t\n") == 0


def test_min_tokens_is_fast_on_what_moses_is_slow_on():
    text = " ".join(["U.S.", "don't", "(x)"] * 7000)  # Moses: about 3 s; 42 000 tokens
    assert min_tokens(text) == 21_000


@settings(max_examples=500, deadline=None)
@given(st.lists(PIECES | st.sampled_from([",", ".", "..", "'s", "n't", "DOTMULTI", "-", "`", "\u0301"]), max_size=40)
       .map("".join) | st.text(max_size=60))  # fmt: skip
def test_max_tokens_is_an_upper_bound(text):
    assert min_tokens(text) <= len(tokenize(text)) <= max_tokens(text)


def test_max_tokens_counts_punctuation_that_whitespace_does_not_split():
    assert max_tokens("a," * 1000) == 2000 == len(tokenize("a," * 1000))
    assert max_tokens("The U.S. economy") == 6 and len(tokenize("The U.S. economy")) == 3
    assert max_tokens("") == max_tokens(" \t\n") == 0


def test_max_tokens_stops_counting_at_the_limit_fast():
    bomb = "a," * 4_000_000  # one word; Moses: 13 s and gigabytes
    assert min_tokens(bomb) == 1
    start = time.perf_counter()
    assert max_tokens(bomb, stop=1001) == 1001
    assert time.perf_counter() - start < 0.1  # a hang detector: it takes well under a millisecond


ASCII_JUNK = st.sampled_from([*(w for w in WORDS if w.isascii()), *(c for c in SPACES_AND_JUNK if c.isascii())])


@settings(max_examples=500, deadline=None)
@given(st.lists(ASCII_JUNK | st.sampled_from([",", "_", "-", "\x1f", "\x0e"]), max_size=40).map("".join)
       | st.text(st.characters(max_codepoint=127), max_size=80), st.sampled_from([None, 0, 1, 3, 10]))  # fmt: skip
def test_an_ascii_text_s_bounds_counted_in_c_are_the_regexes_counts(text, stop):
    # ASCII texts are counted by bytes' translate and count (service/text/moses.py); others by the regexes
    words, pieces = (sum(1 for _ in islice(r.finditer(text), stop)) for r in (moses._WORD, moses._PIECE))
    assert (min_tokens(text, stop), max_tokens(text, stop)) == (words, pieces)
