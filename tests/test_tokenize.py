"""The Moses tokenizer for string requests, and the cheap lower bound that refuses oversized ones first."""

from hypothesis import given, settings
from hypothesis import strategies as st

from service.tokenize import min_tokens, tokenize

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
