"""The queue's policy: which requests wait, which are refused, and which sentences join the engine next (what
text-embeddings-inference's queue.rs is). Pure bookkeeping, unit-testable without an engine: no thread, no lock
(the batcher holds its own around every call), no event loop (a request's future is carried, never touched).

* The queue is bounded in tokens (boundaries included): a request that does not fit is refused at once
  (`QueueFull`: 503 with Retry-After), never left to pile up; one larger than the whole queue could never fit
  (`LargerThanQueue`: 413).
* One line per client (its address), taken from in turns (service/turns.py), a sentence of each at a time: a client
  that sends many long requests at once delays another's small one by a sentence of its own, not by all of them
  (one client on 4 connections pushed a small request's median to 7 s).
* A full queue is shared fairly: a client within its share (the queue's size over the clients waiting, itself
  included) that does not fit pushes out the newest waiting requests of the client holding the most, which get
  the QueueFull instead; a client over its share gets it itself. So one address's flood fills its own share and
  gets the 503s, and another's request is taken (longest queue drop); a client alone may fill the whole queue.
* `take`: the sentences that join next, in turns, as many as fit the token budget beside those in flight (at least
  one when none are: a sentence longer than the budget still runs) and the rows the engine has room for; those
  whose client has gone are dropped as they come up, before they cost compute.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from service.errors import Overloaded, TooLarge
from service.turns import Turns


class QueueFull(Overloaded):
    """The queue cannot take this request now; the client should retry later."""


class LargerThanQueue(TooLarge):
    """The request is larger than the whole queue: it can never be taken, so retrying is no use."""

    def __init__(self, tokens: int, limit: int, field: str | None = None, at_least: bool = False):
        counted = f"at least {tokens}" if at_least else str(tokens)
        super().__init__(
            f"{counted} tokens with 2 boundary tokens per sentence; the limit is {limit} per request (the queue size)",
            field,
        )


@dataclass
class Timings:
    """When a request's sentences were queued, when the first of them joined those in flight, and when the last was
    answered (time.perf_counter() seconds): its wait in the queue and its time in the engine, for tracing."""

    queued: float = 0.0
    started: float | None = None
    answered: float | None = None


@dataclass(eq=False)
class Entry:
    """One request. `gone` is set on the event loop once it is answered, failed or cancelled; the engine
    thread only reads it. `future` is the batcher's, resolved on the event loop (never here)."""

    sentences: list[list[str]]
    future: asyncio.Future | None
    client: str = ""
    enqueued: float = field(default_factory=time.perf_counter)
    gone: bool = False
    timings: Timings | None = None  # filled in when the caller asks (a traced request)

    def __post_init__(self) -> None:
        self.tokens = sum(len(s) + 2 for s in self.sentences)  # what it costs the queue, boundaries included
        self.results: list[object] = [None] * len(self.sentences)  # each sentence's layers, once answered
        self.pending = len(self.sentences)  # sentences not answered yet
        self.waiting = len(self.sentences)  # sentences still in the queue
        self.unfinished = len(self.sentences)  # sentences not finished in flight (engine thread only)


Item = tuple[Entry, int]  # a request and the index of one of its sentences


def tokens(item: Item) -> int:
    """What a sentence costs the queue and the budget: its tokens and its two boundaries."""
    return len(item[0].sentences[item[1]]) + 2


class Queue:
    """The sentences waiting for the engine, at most `size` tokens of them, a line per client taken in turns."""

    def __init__(self, size: int):
        self.size = size
        self.tokens = 0  # tokens waiting, boundaries included
        self._lines = _Lines()

    def __len__(self) -> int:
        """Sentences waiting."""
        return len(self._lines)

    def push(self, entry: Entry) -> list[tuple[Entry, QueueFull]]:
        """Queue every sentence of `entry` at the back of its client's line; the waiting requests pushed out to make
        room, each with the error to fail it with (the caller resolves their futures). Raises LargerThanQueue when
        `entry` alone is over the queue's size, QueueFull when it does not fit now and may push out no one."""
        if entry.tokens > self.size:
            raise LargerThanQueue(entry.tokens, self.size)
        pushed_out = self._push_out(entry.client, entry.tokens) if self.tokens + entry.tokens > self.size else []
        self._lines.extend(entry.client, ((entry, i) for i in range(len(entry.sentences))))
        self.tokens += entry.tokens
        return pushed_out

    def _push_out(self, client: str, needed: int) -> list[tuple[Entry, QueueFull]]:
        """Make room for `needed` tokens of `client` in the full queue by taking out the newest waiting requests of
        the clients holding the most, if `client` stays within its share; QueueFull otherwise."""
        held = self._lines.held.by_address
        mine = held.get(client, 0)
        share = self.size // (len(held) + (client not in held))
        full = f"queue holds {self.tokens} of {self.size} tokens"
        if mine + needed > share:
            raise QueueFull(f"{full}, {mine} of them from your address, whose share is {share} now")
        need, others, victims = self.tokens + needed - self.size, dict(held), []
        others.pop(client, None)
        while need > 0 and others:
            most = max(others, key=others.__getitem__)
            victim = self._lines.newest_whole(most, len([v for v in victims if v.client == most]))
            if victim is None or others[most] <= share:
                del others[most]  # nothing of it may go: the next largest
                continue
            victims.append(victim)
            others[most] -= victim.tokens
            need -= victim.tokens
        if need > 0:
            raise QueueFull(f"{full}, and no request of another client above its share ({share}) waits whole")
        for victim in victims:
            self.drop(victim)
        error = f"{full}: your address held more than its share ({share}) when another's request came"
        return [(victim, QueueFull(error)) for victim in victims]

    def drop(self, entry: Entry) -> None:
        """Take every waiting sentence of `entry` out (answered, failed, cancelled or pushed out): one pass over its
        client's line, however many of its sentences wait."""
        if entry.waiting:
            self.tokens -= sum(map(tokens, self._lines.remove(entry.client, lambda item: item[0] is entry)))
            entry.waiting = 0

    def take(self, budget: int, held: int, room: int, busy: bool) -> list[Item]:
        """The sentences that join next, each client's in order and the clients in turns: as many as fit `budget`
        tokens beside the `held` in flight (at least one when none are in flight: not `busy`) and the engine's
        `room` for rows. Those whose client has gone leave the queue without joining."""
        taken: list[Item] = []
        while self._lines and len(taken) < room:
            cost = tokens(self._lines.first())
            if held + cost > budget and (taken or busy):
                break
            entry, i = self._lines.take()
            self.tokens -= cost
            entry.waiting -= 1
            if not entry.gone:
                taken.append((entry, i))
                held += cost
        return taken

    def oldest(self) -> float:
        """When the sentence that has waited longest was queued (not empty)."""
        return min(entry.enqueued for entry, _ in self._lines.heads())


class _Lines(Turns[Item]):
    """A line of sentences per client, taken from in turns (round robin by sentence: service/turns.py), each
    client's waiting tokens in `held`."""

    def __init__(self) -> None:
        super().__init__(weight=tokens)

    def newest_whole(self, client: str, skip: int = 0) -> Entry | None:
        """The newest request of `client` none of whose sentences has left the queue, after its `skip` newest
        ones; None if there is none (its older ones are being taken)."""
        seen: Entry | None = None
        for entry, _ in reversed(self.line(client)):
            if entry is seen:
                continue
            seen = entry
            if entry.waiting != len(entry.sentences) or entry.gone:
                return None
            if skip == 0:
                return entry
            skip -= 1
        return None
