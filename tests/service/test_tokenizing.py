"""The tokenizing threads (service/tokenizing.py) without a server: texts are tokenized a text at a time in turns by
address, an address's characters in line are bounded (one request alone always taken), a request whose client has
gone leaves the line, an error reaches its request, and in processes a killed one fails only the text it had.
tests/e2e/test_tokenizing.py checks them on a real elmo-serve with Moses."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from service.errors import Overloaded
from service.tokenizing import Abandoned, TokenizerDied, TokenizeTurns


class Gated:
    """A tokenizer (split on spaces) that records what it was given and holds the first text until `go` is set."""

    def __init__(self):
        self.seen: list[str] = []
        self.go, self.started = threading.Event(), threading.Event()

    def __call__(self, text: str, language: str) -> list[str]:
        self.seen.append(text)
        self.started.set()
        assert self.go.wait(10)
        if text == "boom":
            raise ValueError("boom")
        return text.split()


@pytest.fixture
def gated():
    tokenizer = Gated()
    turns = TokenizeTurns(threads=1, per_client_chars=100, tokenize=tokenizer)
    yield turns, tokenizer
    tokenizer.go.set()
    turns.shutdown()


def test_texts_are_tokenized_in_turns_by_address(gated):
    turns, tokenizer = gated
    first = turns.submit("a", ["a0"], "en", threading.Event())
    assert tokenizer.started.wait(10)  # the one worker holds a0
    flood = turns.submit("a", ["a1", "a2", "a3"], "en", threading.Event())
    other = turns.submit("b", ["b0 x", ["kept", "tokens"]], "en", threading.Event())
    tokenizer.go.set()
    assert flood.result(10) == [["a1"], ["a2"], ["a3"]]
    assert other.result(10) == [["b0", "x"], ["kept", "tokens"]]  # a list of tokens stays as it is
    assert first.result(10) == [["a0"]]
    assert tokenizer.seen == ["a0", "a1", "b0 x", "a2", "a3"]  # b's text behind one of a's, not all three


def test_an_address_s_characters_in_line_are_bounded_one_request_alone_always_taken(gated):
    turns, tokenizer = gated
    big = turns.submit("a", ["x" * 150], "en", threading.Event())  # over the bound, but alone: taken
    assert turns.held("a") == 150
    with pytest.raises(Overloaded, match="hold 150 of 100 characters"):
        turns.submit("a", ["y"], "en", threading.Event())
    small = turns.submit("b", ["z" * 60], "en", threading.Event())  # another address's own bound
    with pytest.raises(Overloaded):
        turns.submit("b", ["z" * 41], "en", threading.Event())
    tokenizer.go.set()
    assert big.result(10) == [["x" * 150]] and small.result(10) == [["z" * 60]]
    assert turns.held("a") == 0 and turns.held("b") == 0  # released once done
    assert turns.submit("a", ["y"], "en", threading.Event()).result(10) == [["y"]]


def test_a_request_whose_client_has_gone_leaves_the_line(gated):
    turns, tokenizer = gated
    turns.submit("a", ["a0"], "en", threading.Event())
    assert tokenizer.started.wait(10)
    stop = threading.Event()
    gone = turns.submit("b", ["b0", "b1"], "en", stop)
    stop.set()
    tokenizer.go.set()
    with pytest.raises(Abandoned):
        gone.result(10)
    assert "b0" not in tokenizer.seen and turns.held("b") == 0


def test_an_error_reaches_its_request_and_the_threads_keep_serving(gated):
    turns, tokenizer = gated
    tokenizer.go.set()
    with pytest.raises(ValueError, match="boom"):
        turns.submit("a", ["boom"], "en", threading.Event()).result(10)
    assert turns.submit("a", ["fine"], "en", threading.Event()).result(10) == [["fine"]]


def split_or_die(text: str, language: str) -> list[str]:
    """A tokenizer for the processes (a module's function pickles by name): "die" kills its process."""
    if text == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    return text.split()


def test_in_processes_a_killed_one_fails_its_text_and_the_next_text_is_served():
    turns = TokenizeTurns(threads=1, per_client_chars=1000, tokenize=split_or_die, processes=True)
    try:
        assert turns.submit("a", ["x y", ["kept"]], "en", threading.Event()).result(60) == [["x", "y"], ["kept"]]
        with pytest.raises(TokenizerDied):  # as a process killed for memory would: its text fails
            turns.submit("a", ["die"], "en", threading.Event()).result(60)
        assert turns.submit("b", ["z"], "en", threading.Event()).result(60) == [["z"]]  # in a new process
        assert turns.held("a") == turns.held("b") == 0
    finally:
        turns.shutdown()
