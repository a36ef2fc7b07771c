"""Admission, below HTTP: every per-request limit and budget, unit-tested without a server (the end-to-end tests
in tests/e2e/ check the same refusals through a real one)."""

from __future__ import annotations

import time

import pytest

from service.admission import Admission, KeyedBudget, answer_budget, answer_bytes, body_budget
from service.errors import InvalidRequest, Overloaded, TooLarge
from service.metrics import Metrics
from service.settings import Settings


@pytest.fixture
def admission(tmp_path) -> Admission:
    return Admission(Settings(model_dir=tmp_path, max_sentences=4, max_tokens_per_sentence=10, queue_tokens=40,
                              max_text_chars=1000, max_answer_bytes=10_000))  # fmt: skip


def test_counts_before_tokenizing_name_the_field(admission):
    admission.before_tokenizing([["a", "b"], "a text"], "sentences", truncate=False)  # within every limit
    cases = [
        ([["a"]] * 5, "sentences: 5 sentences; the limit is 4 per request"),
        ([["a"], "x" * 1001], "sentences[1]: 1001 characters; the limit is 1000 per text"),
        ([["a"] * 11], "sentences[0]: 11 tokens; the limit is 10"),
        (["one two three four five six seven eight nine ten eleven"], "sentences[0]: at least 11 tokens"),
        (["a," * 6], "sentences[0]: over 10 words and punctuation marks"),  # 3 words by whitespace, 12 tokens
        ([["a"] * 10] * 4, "sentences: 48 tokens with 2 boundary tokens per sentence; the limit is 40"),
    ]
    for items, message in cases:
        with pytest.raises(TooLarge) as refused:
            admission.before_tokenizing(items, "sentences", truncate=False)
        assert refused.value.detail.startswith(message), refused.value.detail


def test_a_hopeless_text_is_refused_in_milliseconds_without_moses(admission):
    text = "word " * 200_000  # 200,000 words: Moses would take seconds over it
    admission.settings.max_text_chars = 2_000_000
    start = time.perf_counter()
    with pytest.raises(TooLarge, match=r"^at least 200000 tokens; the limit is 10$") as refused:
        admission.before_tokenizing([text], "sentences", truncate=False)
    assert time.perf_counter() - start < 0.5 and refused.value.field == "sentences[0]"


def test_truncate_cuts_to_the_limit_and_reports_the_cut(admission):
    admission.before_tokenizing([["a"] * 11], "input", truncate=True)  # a list is cut, not refused
    sentences, cuts = admission.tokens([["a"] * 11, ["b"]], "input", truncate=True)
    assert [len(s) for s in sentences] == [10, 1]
    assert cuts == [{"truncated": True, "original_tokens": 11}, {"truncated": False, "original_tokens": 1}]
    with pytest.raises(TooLarge, match=r"over 160 words .* to truncate"):  # TRUNCATE_READS x the limit
        admission.before_tokenizing(["a," * 100], "input", truncate=True)


def test_tokens_refuse_empty_and_unencodable_sentences(admission):
    with pytest.raises(InvalidRequest, match=r"^empty sentence$") as empty:
        admission.tokens([["a"], []], "sentences", truncate=False)
    assert empty.value.field == "sentences[1]"
    with pytest.raises(InvalidRequest, match="lone surrogate"):
        admission.tokens([["\ud800"]], "sentences", truncate=False)


def test_answer_size_is_an_upper_bound_and_names_the_ways_out(admission):
    size = admission.answer_size(4, [["a", "b"]], 1, False, "float", "sentences", "fewer")
    assert size == answer_bytes([2], 4, 1, False, "float") == 2 * (4 * 17 + 3)
    with pytest.raises(TooLarge, match=r"an answer of up to \d+ bytes .* ask for fewer"):
        admission.answer_size(1024, [["a"] * 10], 3, False, "float", "sentences", "fewer")


def test_the_answer_budget_refuses_past_its_limit_and_takes_back_what_is_given():
    metrics = Metrics()
    budget = KeyedBudget(100, None, "answers being made or sent", "to your address", metrics.answer_bytes)
    budget.take("", 60)
    with pytest.raises(Overloaded, match="hold 60 of 100 bytes"):
        budget.take("", 41)
    budget.give_back("", 60)
    budget.take("", 100)
    assert metrics.registry.get_sample_value("elmo_answer_bytes_held") == 100


def test_the_body_budget_bounds_the_total_and_each_address():
    metrics = Metrics()
    budget = body_budget(
        Settings().model_copy(update={"max_inflight_bytes": 100, "max_inflight_bytes_per_client": 60}), metrics
    )
    budget.take("a", 60)
    with pytest.raises(Overloaded, match="request bodies in flight from your address hold 60 of 60") as refused:
        budget.take("a", 1)
    assert refused.value.status == 503
    budget.take("b", 40)
    with pytest.raises(Overloaded, match="request bodies in flight hold 100 of 100"):
        budget.take("c", 1)
    assert metrics.registry.get_sample_value("elmo_body_bytes_held") == 100
    budget.give_back("a", 60)
    assert budget.by_key == {"b": 40} and budget.held == 40


def test_a_request_over_the_queue_however_truncate_cuts_it_is_refused_before_the_upper_bound(admission, monkeypatch):
    # 100 texts of 16,000 words with truncate: each is cut to the limit, and still they are over the queue. Refused on
    # the words by whitespace (counted to the limit each), before the upper bound reads 16 times the limit of each.
    from service import admission as module

    admission.settings.max_text_chars, admission.settings.max_sentences = 200_000, 100
    monkeypatch.setattr(module, "max_tokens", lambda *_, **__: pytest.fail("the upper bound was counted"))
    with pytest.raises(TooLarge) as refused:
        admission.before_tokenizing(["word " * 16_000] * 100, "sentences", truncate=True)
    assert refused.value.detail == (
        "sentences: at least 1200 tokens with 2 boundary tokens per sentence; the limit is 40 per request (the queue "
        "size)"
    )
    assert refused.value.field == "sentences"


def test_the_answer_budget_bounds_each_address_too():
    budget = answer_budget(
        Settings().model_copy(update={"max_answers_inflight_bytes": 100, "max_answers_inflight_bytes_per_client": 60})
    )
    budget.take("a", 60)
    with pytest.raises(Overloaded, match="to your address hold 60 of 60 bytes"):
        budget.take("a", 1)
    budget.take("b", 40)  # another address still has the rest
    with pytest.raises(Overloaded, match="answers being made or sent hold 100 of 100 bytes"):
        budget.take("c", 1)
    budget.give_back("a", 60)
    assert budget.by_key == {"b": 40} and budget.held == 40
