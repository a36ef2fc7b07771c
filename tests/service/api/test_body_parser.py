"""The off-loop body parser (service/api/bodies.py) against the standard one: for any JSON text, whole, cut
anywhere or mutated, both accept it (and build the same value) or both refuse it, and a refusal is always
json.JSONDecodeError (which the route answers 422 naming the place), never another exception (an IndexError
from reading past the end of a body cut after a comma was a 500 and a traceback per request).

The parser reads a list or object shorter than its window in one call of json's scanner, and a longer one piece
by piece, many items at once where it can (`run`): the window is made small here so that short texts go through
every path. Nesting stays within the parser's depth bound and counts within its limits: past those it refuses by
design what json.loads accepts (tests/service/api/test_errors.py covers those refusals)."""

from __future__ import annotations

import json
import threading
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from service.api import bodies

KEYS = st.sampled_from(["sentences", "input", "layers", "a", "", 'q"uo,te', "[,]"])
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(alphabet=st.sampled_from('ab ,"[]{}:\\\u00e9\U0001f600'), max_size=6)
)
DOCUMENTS = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=8) | st.dictionaries(KEYS, inner, max_size=4),
    max_leaves=40,
).filter(lambda value: _depth(value) < bodies.MAX_DEPTH)
# where a text is cut or changed: the characters that end or separate JSON's values, and some that break them
NOISE = st.sampled_from([*',[]{}":\\ \t\n0e-.', "nul", "tru", '"\\u12', "NaN", "\ud800"])


def _depth(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


def _verdict(parse, text: str):
    """("ok", the value as canonical JSON) or ("refused", None); any other exception escapes, failing the test."""
    try:
        value = parse(text)
    except json.JSONDecodeError:
        return "refused", None
    return "ok", json.dumps(value, sort_keys=True, allow_nan=True)


def _off_loop(text: str):
    return bodies._Parser(text, "sentences", 10**6, threading.Event()).document()


def _compare(text: str) -> None:
    for window in (2, 7, 64, bodies.WINDOW):  # every list past the window (piece by piece), and none
        with mock.patch.object(bodies, "WINDOW", window):
            assert _verdict(_off_loop, text) == _verdict(json.loads, text), (window, text)


@st.composite
def _mutated(draw) -> str:
    text = json.dumps(draw(DOCUMENTS), indent=draw(st.sampled_from([None, 0, 1])), ensure_ascii=draw(st.booleans()))
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(text)))
        change = draw(st.sampled_from(["cut", "insert", "delete", "replace"]))
        if change == "cut":
            text = text[:at]
        elif change == "insert":
            text = text[:at] + draw(NOISE) + text[at:]
        elif change == "delete":
            text = text[:at] + text[at + 1 :]
        else:
            text = text[:at] + draw(NOISE) + text[at + 2 :]
    return text


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(DOCUMENTS, st.sampled_from([None, 0, 2]))
def test_whole_documents_read_as_json_reads_them(document, indent):
    _compare(json.dumps(document, indent=indent))


@settings(max_examples=1200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(_mutated())
@example('{"sentences": [["a", "a",')  # the body, cut after a comma
@example('{"sentences": ["a", "b",')
@example('{"sentences": ["a", "b", ')
@example('{"sentences": [1, 2,]}')
@example('["a",,"b"]')
def test_cut_and_mutated_documents_get_json_s_verdict(text):
    _compare(text)


@pytest.mark.parametrize("cut", range(1, 40))
def test_a_long_sentence_list_cut_anywhere_is_refused_as_invalid_json(cut):
    """A body the size the server reads off the loop (past INLINE_BYTES), cut at each of the last 40 places."""
    whole = json.dumps({"sentences": [["a"] * 3000, *(["word", "b,c"] for _ in range(2000))], "output": "mean"})
    assert len(whole) > bodies.INLINE_BYTES
    text = whole[:-cut]
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    with pytest.raises(json.JSONDecodeError) as refused:
        _off_loop(text)
    assert refused.value.pos <= len(text)
