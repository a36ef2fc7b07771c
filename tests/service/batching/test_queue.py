"""The queue's policy (service/batching/queue.py) alone, without an engine, a thread or an event loop: the token
bound, the clients' turns, the budget a take fills, push-out when full, and the requests whose client has gone. The
batcher's tests (tests/service/batching/test_batcher.py) check the same policy through a real engine."""

from __future__ import annotations

import pytest

from service.batching.queue import Entry, LargerThanQueue, Queue, QueueFull, tokens


def request(client: str, *lengths: int, enqueued: float = 0.0) -> Entry:
    """A request of `client` with sentences of `lengths` tokens (each costs 2 more: its boundaries)."""
    sentences = [[f"{client}{k}"] * n for k, n in enumerate(lengths)]
    return Entry(sentences, None, client, enqueued=enqueued)


def names(taken) -> list[str]:
    return [entry.sentences[i][0] for entry, i in taken]


def test_the_queue_counts_each_sentences_tokens_and_boundaries_and_refuses_a_request_larger_than_itself():
    queue = Queue(20)
    assert queue.push(request("a", 3, 5)) == [] and queue.tokens == 12 and len(queue) == 2
    with pytest.raises(LargerThanQueue, match="21 tokens with 2 boundary tokens per sentence; the limit is 20"):
        queue.push(request("b", 19))
    assert queue.tokens == 12 and len(queue) == 2  # nothing of it was queued


def test_clients_take_turns_a_sentence_each_every_clients_in_order():
    queue = Queue(1000)
    queue.push(request("a", 1, 1, 1))
    queue.push(request("b", 1))
    queue.push(request("c", 1, 1))
    taken = queue.take(budget=1000, held=0, room=10, busy=False)
    assert names(taken) == ["a0", "b0", "c0", "a1", "c1", "a2"]
    assert queue.tokens == 0 and not queue and all(entry.waiting == 0 for entry, _ in taken)


def test_a_take_fills_the_budget_beside_those_in_flight_and_the_rows_the_engine_has_room_for():
    queue = Queue(1000)
    queue.push(request("a", 8, 8, 8, 8))  # 10 tokens each
    assert names(queue.take(budget=25, held=0, room=10, busy=False)) == ["a0", "a1"]  # a third would be 30
    assert names(queue.take(budget=25, held=20, room=10, busy=True)) == []  # 20 in flight: 10 more do not fit
    assert names(queue.take(budget=100, held=0, room=1, busy=False)) == ["a2"]  # one row free
    assert queue.tokens == 10 and len(queue) == 1


def test_a_sentence_longer_than_the_budget_runs_alone_when_nothing_is_in_flight():
    queue = Queue(1000)
    queue.push(request("a", 98, 1))  # 100 tokens, then 3
    assert names(queue.take(budget=10, held=0, room=10, busy=True)) == []  # it waits while others run
    assert names(queue.take(budget=10, held=0, room=10, busy=False)) == ["a0"]  # alone, over the budget
    assert names(queue.take(budget=10, held=100, room=10, busy=True)) == []


def test_the_sentences_of_a_request_whose_client_has_gone_leave_without_joining():
    queue = Queue(1000)
    gone, kept = request("a", 1, 1), request("b", 1)
    queue.push(gone)
    queue.push(kept)
    gone.gone = True  # cancelled while its first sentence waited
    assert names(queue.take(budget=1000, held=0, room=10, busy=False)) == ["b0"]
    assert queue.tokens == 0 and gone.waiting == 0


def test_drop_takes_every_waiting_sentence_of_a_request_and_its_tokens_out():
    queue = Queue(1000)
    first, second = request("a", 2, 3), request("a", 4)
    queue.push(first)
    queue.push(second)
    queue.take(budget=1000, held=0, room=1, busy=False)  # a0 joined; a1 still waits
    queue.drop(first)
    assert first.waiting == 0 and queue.tokens == 6 and len(queue) == 1
    queue.drop(first)  # nothing of it waits any more: nothing changes
    assert queue.tokens == 6
    assert names(queue.take(budget=1000, held=0, room=10, busy=False)) == ["a0"]  # second's own sentence


def test_a_full_queue_pushes_out_the_newest_request_of_the_client_holding_the_most():
    # 40 tokens; a holds them all in four requests of 10. b, within its share (20 of 40 with two clients waiting),
    # pushes out a's newest request, which gets the QueueFull to fail with; a, over its share, is refused itself
    queue = Queue(40)
    a = [request("a", 8) for _ in range(4)]
    for entry in a:
        queue.push(entry)
    pushed_out = queue.push(request("b", 8))
    assert [victim for victim, _ in pushed_out] == [a[3]] and a[3].waiting == 0
    assert "queue holds 40 of 40 tokens: your address held more than its share (20)" in str(pushed_out[0][1])
    assert isinstance(pushed_out[0][1], QueueFull) and queue.tokens == 40
    with pytest.raises(QueueFull, match="30 of them from your address, whose share is 20 now"):
        queue.push(request("a", 8))
    assert queue.tokens == 40 and names(queue.take(1000, 0, 10, False)) == ["a0", "b0", "a0", "a0"]


def test_push_out_takes_a_whole_request_of_the_client_holding_the_most_never_a_partly_taken_one():
    queue = Queue(40)
    a = [request("a", 8), request("a", 8, 8)]  # 10, then 20 in one request
    for entry in a:
        queue.push(entry)
    queue.push(request("c", 8))  # 40 of 40
    pushed_out = queue.push(request("b", 8))  # 10 wanted, within b's share (13 of 40, three clients): a's newest goes
    assert [victim for victim, _ in pushed_out] == [a[1]] and queue.tokens == 30
    # a request one of whose sentences has joined those in flight is not whole: it may not be pushed out
    queue = Queue(30)
    partly = request("a", 8, 8, 8)
    queue.push(partly)
    queue.take(budget=1000, held=0, room=1, busy=False)  # its first sentence joined; 20 tokens still wait
    with pytest.raises(QueueFull, match=r"no request of another client above its share \(15\) waits whole"):
        queue.push(request("d", 10))
    assert queue.tokens == 20 and partly.waiting == 2


def test_a_client_alone_may_fill_the_whole_queue():
    queue = Queue(30)
    for _ in range(3):
        assert queue.push(request("a", 8)) == []
    with pytest.raises(QueueFull, match="30 of them from your address, whose share is 30 now"):
        queue.push(request("a", 1))


def test_the_oldest_is_when_the_first_waiting_sentence_was_queued_and_tokens_names_a_sentences_cost():
    queue = Queue(100)
    queue.push(request("a", 1, enqueued=5.0))
    queue.push(request("b", 4, enqueued=3.0))
    assert queue.oldest() == 3.0
    entry = request("x", 7)
    assert tokens((entry, 0)) == 9 == entry.tokens
