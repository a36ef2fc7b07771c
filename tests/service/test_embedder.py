"""The embedder (service/embedder.py) without an app: a job through admission, Moses, the answer budget and a real
tiny model's queue, in that order; the vectors as allennlp's, the answer's size held exactly while the Hold is open
and back to 0 after, and each refusal before the steps after it. tests/e2e/ checks the same through the routes."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from service import spans
from service.admission import answer_budget, answer_bytes
from service.embedder import Ask, Caller, Embedder, Job
from service.errors import NotReady, Overloaded, TooLarge
from service.metrics import Metrics
from service.models import load_models
from service.settings import Settings
from service.text.moses import tokenize
from service.tokenizing import TokenizeTurns
from tests.conftest import max_error


async def passed_through(work):
    return await work


def pipeline(model_dir, ready=True, **limits):
    """An embedder, the answer budget and the models of `model_dir`, for `limits` (Settings' fields)."""
    settings = Settings(model_dir=model_dir, intra_op_threads=1, **limits)
    metrics = Metrics()
    tokenizer = TokenizeTurns(1, settings.max_body_bytes, tokenize, metrics.observe_stage)
    embedder = Embedder(settings, metrics, tokenizer, spans.tracer(), ready=lambda: ready)
    return embedder, answer_budget(settings, metrics), load_models(settings, metrics)


def run(model_dir, steps, ready=True, **limits):
    """`steps(embedder, budget, models)` in an event loop, the models' queues running around it."""
    embedder, budget, models = pipeline(model_dir, ready, **limits)

    async def main():
        await models.start()
        try:
            return await steps(embedder, budget, models)
        finally:
            await models.stop()
            embedder.tokenizer.shutdown()

    return asyncio.run(main())


def test_a_job_is_embedded_as_allennlp_and_its_answer_held_until_the_hold_closes(tiny_model_dir, sentences, expected):
    noted = {}

    async def steps(embedder, budget, models):
        model = models.get(None)
        ask = Ask(model.num_layers, "layers")
        job = Job(model, sentences, "sentences", ask=ask, encoding="base64")
        with budget.holding("10.0.0.1") as hold:
            caller = Caller("10.0.0.1", hold, passed_through, note=lambda **known: noted.update(known))
            embedded = await embedder.embed(job, caller)
            held = budget.held, budget.by_key.get("10.0.0.1"), hold.size
        queued = embedder.metrics.registry.get_sample_value("elmo_stage_seconds_count", {"stage": "engine"})
        return model, embedded, (*held, budget.held, queued)

    model, embedded, held = run(tiny_model_dir, steps)
    size = answer_bytes([len(s) for s in sentences], model.dim, 3, False, "base64")
    assert embedded.size == size and held == (size, size, size, 0, 1.0)  # held while open, 0 after; queued once
    assert max_error([embedded.job.ask.vectors(layers) for layers in embedded.layers], expected) <= 1e-5
    assert embedded.numbers == sum(map(len, sentences)) * model.dim * 3
    assert noted == {"model": model.name, "sentences": len(sentences), "tokens": sum(map(len, sentences))}


def test_texts_are_tokenized_by_moses_and_cut_with_truncate(tiny_model_dir):
    async def steps(embedder, budget, models):
        model = models.get(None)
        ask = Ask(model.num_layers, "mix", [([0.0] * model.num_layers, 1.0, "softmax", False)], pooling="mean")
        job = Job(model, ["Hello, world!", "one two three four five"], "input", truncate=True, ask=ask)
        with budget.holding("a") as hold:
            embedded = await embedder.embed(job, Caller("a", hold, passed_through))
        return embedded, budget.held

    embedded, held_after = run(tiny_model_dir, steps, max_tokens_per_sentence=3)
    assert embedded.sentences == [["Hello", ",", "world"], ["one", "two", "three"]]
    assert embedded.cuts == [{"truncated": True, "original_tokens": 4}, {"truncated": True, "original_tokens": 5}]
    vectors = [embedded.job.ask.vectors(layers) for layers in embedded.layers]
    assert [v.shape for v in vectors] == [(32,), (32,)] and held_after == 0


@pytest.mark.parametrize(
    "limits, taken, error, field, message",
    [
        (
            {"max_answer_bytes": 1000},
            0,
            TooLarge,
            "sentences",
            "the limit is 1000 bytes per answer: ask for fewer sentences",
        ),
        (
            {"max_answer_bytes": 10**7, "max_answers_inflight_bytes": 10**7},
            10**7 - 100,  # by another address
            Overloaded,
            None,  # a 503 is about the server, not a field
            "answers being made or sent hold 9999900 of 10000000 bytes",
        ),
    ],
)
def test_an_answer_the_limits_refuse_is_never_queued_nor_held(
    tiny_model_dir, sentences, limits, taken, error, field, message
):
    async def steps(embedder, budget, models):
        model = models.get(None)
        job = Job(model, sentences, "sentences", ask=Ask(model.num_layers, "layers"), ways_out="fewer sentences")
        budget.take("b", taken)
        with budget.holding("a") as hold, pytest.raises(error) as refused:
            await embedder.embed(job, Caller("a", hold, passed_through))
        queued = embedder.metrics.registry.get_sample_value("elmo_stage_seconds_count", {"stage": "engine"})
        return refused.value, hold.size, queued, budget.held

    refused, held, queued, held_in_all = run(tiny_model_dir, steps, **limits)
    assert message in str(refused) and refused.field == field and held == 0 and queued is None
    assert held_in_all == taken  # the other address's alone


def test_not_ready_is_refused_after_the_budget_and_before_the_queue(tiny_model_dir):
    async def steps(embedder, budget, models):
        model = models.get(None)
        job = Job(model, [["a", "b"]], "sentences", ask=Ask(model.num_layers, "layers"))
        with budget.holding("a") as hold:
            with pytest.raises(NotReady):
                await embedder.embed(job, Caller("a", hold, passed_through))
            held = hold.size
        return held, budget.held

    held, after = run(tiny_model_dir, steps, ready=False)
    assert held == answer_bytes([2], 32, 3, False, "float") and after == 0


def test_tokenized_is_the_first_steps_alone(tiny_model_dir):
    noted = []

    async def steps(embedder, budget, models):
        model = models.get(None)
        with budget.holding("a") as hold:
            caller = Caller("a", hold, passed_through, note=lambda **known: noted.append(known))
            tokens = await embedder.tokenized(Job(model, ["Dr. Smith came."], "sentences"), caller)
        return model, tokens, hold.size

    model, (sentences, cuts), held = run(tiny_model_dir, steps)
    assert sentences == [["Dr.", "Smith", "came", "."]] and cuts == [{}] and held == 0
    assert noted == [{"model": model.name}, {"sentences": 1, "tokens": 4}]


def test_float16_is_rounded_once_after_the_mix(tiny_model_dir, sentences):
    async def steps(embedder, budget, models):
        model = models.get(None)
        mix = [([1.0, 0.0, -1.0], 2.0, "softmax", True)]
        half, full = (Ask(model.num_layers, "mix", mix, dtype=dtype) for dtype in ("float16", "float32"))
        with budget.holding("a") as hold:
            embedded = await embedder.embed(
                Job(model, sentences[:2], "sentences", ask=full), Caller("a", hold, passed_through)
            )
        return [(half.vectors(x), full.vectors(x)) for x in embedded.layers]

    for half, full in run(tiny_model_dir, steps):
        assert half.dtype == np.float16 and np.array_equal(half, full.astype(np.float16))
