"""Every limit and budget a request meets, below HTTP, in the order it meets them:

1. its body, as it arrives: at most `max_body_bytes` (413), and the bodies in flight at most `max_inflight_bytes`
   together and `max_inflight_bytes_per_client` from one address (503): `body_budget`, applied by the body-limit
   middleware (service/api/middleware.py) before anything parses the body;
2. its sentences, counted before any tokenizing (`Admission.before_tokenizing`): how many, how long a text, cheap
   lower and upper bounds on the tokens Moses would make, and the queue's size, so a hopeless request is refused
   in milliseconds and never costs a tokenization;
3. its tokens (`Admission.tokens`): no empty sentence, valid Unicode, at most `max_tokens_per_sentence` each (or
   cut to it with `truncate`);
4. its answer's size, estimated before the engine runs (`Admission.answer_size`): at most `max_answer_bytes`
   (413), and the answers being made or sent at most `max_answers_inflight_bytes` together and
   `max_answers_inflight_bytes_per_client` to one address (`answer_budget`, 503);
5. its model's queue (service/batching/batcher.py): 503 when full, per model.

Each refusal is a ServiceError (service/errors.py) whose message names the field and the way out.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from service.batching.batcher import LargerThanQueue
from service.errors import InvalidRequest, Overloaded, TooLarge
from service.metrics import Metrics
from service.settings import Settings
from service.text.moses import max_tokens, min_tokens

# With truncate, a text is not refused for its tokens but cut after Moses has read it: up to this many times the
# limit (by the upper bound that counts punctuation), so that Moses's work stays bounded.
TRUNCATE_READS = 16

# The most bytes one number of an answer takes (service/api/answers.py writes them): orjson writes a float32 in at
# most 16 characters ("-0.0000037214047") and a comma (11 to 14 on average); base64 writes its 4 bytes as 16/3
# characters. An .npz stores 4 bytes a number, and per item an .npy header (128 bytes) and two zip64 headers
# (about 200).
BYTES_PER_NUMBER = {"float": 17, "base64": 16 / 3, "npz": 4}
NPZ_ITEM_BYTES = 400


def answer_bytes(token_counts: list[int], dim: int, outputs: int, pooled: bool, encoding: str) -> int:
    """At most how many bytes the vectors of an answer take: tokens (or sentences, when pooled) x layers or
    mixes x (dim x bytes per number of the encoding, + 3 for a vector's brackets or quotes and a comma); the
    tokens echoed back are bounded by the body."""
    vectors = (len(token_counts) if pooled else sum(token_counts)) * outputs
    items = len(token_counts) * NPZ_ITEM_BYTES if encoding == "npz" else 0
    return math.ceil(vectors * (dim * BYTES_PER_NUMBER[encoding] + 3)) + items


class Admission:
    """The per-request limits of `settings` (steps 2 to 4 above)."""

    def __init__(self, settings: Settings):
        self.settings = settings

    def before_tokenizing(self, items: Sequence[list[str] | str], field: str, truncate: bool) -> None:
        """Refuse (413) on counts that need no tokenizing: sentences per request, characters per text, a lower
        bound on a text's tokens over the limit (unless `truncate` cuts it), the request over the queue's size by
        those lower bounds (each cut to the limit: truncate cannot save it), an upper bound over what Moses may
        read, and the request over the queue's size by the upper bounds (every model's queue holds
        `queue_tokens`)."""
        s = self.settings
        if len(items) > s.max_sentences:
            raise TooLarge(f"{len(items)} sentences; the limit is {s.max_sentences} per request", field)
        for i, x in enumerate(items):
            if isinstance(x, str) and len(x) > s.max_text_chars:
                raise TooLarge(f"{len(x)} characters; the limit is {s.max_text_chars} per text", f"{field}[{i}]")
        limit, least = s.max_tokens_per_sentence, 0
        for i, x in enumerate(items):
            # by whitespace, counted no further than the limit: a text of 16,000 words costs what one of 1,001 does
            n = min_tokens(x, stop=limit + 1) if isinstance(x, str) else len(x)
            if n > limit and not truncate:
                counted = f"at least {min_tokens(x)}" if isinstance(x, str) else str(n)  # counted whole, once
                raise TooLarge(f"{counted} tokens; the limit is {limit}", f"{field}[{i}]")
            least += min(n, limit) + 2
        if least > s.queue_tokens:  # however Moses splits the texts and truncate cuts them: before the upper bound
            raise LargerThanQueue(least, s.queue_tokens, field, at_least=any(isinstance(x, str) for x in items))
        at_most = self._at_most(items, field, truncate)  # before Moses reads a text
        if (total := sum(at_most) + 2 * len(items)) > s.queue_tokens:
            raise LargerThanQueue(total, s.queue_tokens, field)

    def _at_most(self, items: Sequence[list[str] | str], field: str, truncate: bool) -> list[int]:
        """Each sentence's tokens, or for a text an upper bound on what Moses will make of it, as queued (with
        `truncate`, at most the limit): over the limit (with `truncate`, over TRUNCATE_READS times it), 413 before
        Moses reads it (`"a," * 4_000_000` is one word by whitespace and 8 million tokens)."""
        limit = self.settings.max_tokens_per_sentence
        readable = limit * TRUNCATE_READS if truncate else limit
        counts = [max_tokens(x, stop=readable + 1) if isinstance(x, str) else len(x) for x in items]
        for i, n in enumerate(counts):
            if (isinstance(items[i], str) and n > readable) if truncate else n > limit:  # a list is cut, not read
                cut = f" to truncate (at most {readable})" if truncate else ""
                raise TooLarge(
                    f"over {readable} words and punctuation marks (each may be a token){cut}; the limit is {limit} "
                    "tokens: send it shorter, or as a list of tokens",
                    f"{field}[{i}]",
                )
        return [min(n, limit) for n in counts]

    def tokens(
        self, sentences: list[list[str]], field: str, truncate: bool, empty: bool = False
    ) -> tuple[list[list[str]], list[dict]]:
        """The sentences as queued, and what each item reports of its cut: no empty sentence (unless `empty`: its
        boundaries are then all there is to compute), no lone surrogate
        (JSON may escape one; the answer could not echo it as UTF-8), at most `max_tokens_per_sentence` tokens
        each; with `truncate` a longer one is cut to its first that many (TEI's auto-truncate) instead of a 413."""
        limit = self.settings.max_tokens_per_sentence
        for i, tokens in enumerate(sentences):
            if not tokens and not empty:
                raise InvalidRequest("empty sentence", f"{field}[{i}]")
            if _has_surrogate(tokens):
                raise InvalidRequest("not valid Unicode (a lone surrogate such as \\ud800)", f"{field}[{i}]")
            if len(tokens) > limit and not truncate:
                raise TooLarge(f"{len(tokens)} tokens; the limit is {limit}", f"{field}[{i}]")
        if not truncate:
            return sentences, [{}] * len(sentences)
        cuts = [{"truncated": len(s) > limit, "original_tokens": len(s)} for s in sentences]
        return [s[:limit] for s in sentences], cuts

    def answer_size(
        self,
        dim: int,
        sentences: list[list[str]],
        outputs: int,
        pooled: bool,
        encoding: str,
        field: str,
        ways_out: str,
        boundaries: bool = False,
    ) -> int:
        """The answer's size for vectors of `dim` (`boundaries`: two more positions a sentence), estimated before
        the engine runs; 413 over the limit, naming the ways out."""
        counts = [len(s) + 2 * boundaries for s in sentences]
        size = answer_bytes(counts, dim, outputs, pooled, encoding)
        if size > (limit := self.settings.max_answer_bytes):
            vectors = len(sentences) if pooled else sum(counts)
            shape = f"{outputs} x {vectors} vectors of {dim}" if outputs > 1 else f"{vectors} vectors of {dim}"
            raise TooLarge(
                f"an answer of up to {size} bytes ({shape} numbers as {encoding}); the limit is {limit} bytes per "
                f"answer: ask for {ways_out}",
                field,
            )
        return size


def _has_surrogate(tokens: list[str]) -> bool:
    try:
        "".join(tokens).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class KeyedBudget:
    """Bytes held in flight, bounded together (`limit`) and per key (`per_key`: a client address), taken as they
    come (`take`: Overloaded, 503 with Retry-After, when either bound cannot hold them) and given back when done
    with (`give_back`). One class for both budgets:

    - the bodies in flight (`what="request bodies in flight"`, `whose="from your address"`): each part of a body
      as it arrives, given back once the request is answered, refused or abandoned (service/api/middleware.py's
      BodyLimit), so that one client cannot take the whole budget with a few stalled uploads;
    - the answers being made or sent (`what="answers being made or sent"`, `whose="to your address"`): an answer's
      estimated size before the engine runs (service/embedder.py), given back once it is sent or its client has
      gone: the request holds it from AnswerRelease's `holding` block (service/api/middleware.py), around the
      routes and the sending, which is its lifetime.
      Without it, clients that ask for large answers and never read them held memory for as long as they stayed
      (the write timeout closes them; this bounds what they hold meanwhile); without the bound per address, one
      address's flood of large answers held the whole budget, and other addresses' small requests got 503.

    A key over its own share is told so first: its own requests are what to slow down."""

    def __init__(self, limit: int, per_key: int | None, what: str, whose: str, gauge=None):
        self.limit, self.per_key, self.what, self.whose = limit, per_key or limit, what, whose
        self.held = 0
        self.by_key: dict[str, int] = {}  # the same, per key (present while it holds any)
        if gauge is not None:
            gauge.set_function(lambda: self.held)

    def take(self, key: str, size: int) -> None:
        """Hold `size` more bytes for `key`, or Overloaded."""
        if (mine := self.by_key.get(key, 0)) + size > self.per_key:
            raise Overloaded(f"overloaded: {self.what} {self.whose} hold {mine} of {self.per_key} bytes; retry later")
        if self.held + size > self.limit:
            raise Overloaded(f"overloaded: {self.what} hold {self.held} of {self.limit} bytes; retry later")
        self.held += size
        self.by_key[key] = mine + size

    def give_back(self, key: str, size: int) -> None:
        if not size:
            return
        self.held -= size
        if left := self.by_key[key] - size:
            self.by_key[key] = left
        else:
            del self.by_key[key]

    @contextmanager
    def holding(self, key: str) -> Iterator[Hold]:
        """What `key` takes through the Hold in the block, all given back when the block ends, however it ends."""
        hold = Hold(self, key)
        try:
            yield hold
        finally:
            self.give_back(key, hold.size)
            hold.size = 0


class Hold:
    """What one request holds of a KeyedBudget (`KeyedBudget.holding`): taken as it goes, given back at once."""

    __slots__ = ("budget", "key", "size")

    def __init__(self, budget: KeyedBudget, key: str):
        self.budget, self.key, self.size = budget, key, 0

    def take(self, size: int) -> None:
        """Hold `size` more bytes, or Overloaded (nothing taken)."""
        self.budget.take(self.key, size)
        self.size += size


def body_budget(settings: Settings, metrics: Metrics | None = None) -> KeyedBudget:
    """The budget of the request bodies in flight (step 1 above)."""
    gauge = metrics.body_bytes if metrics is not None else None
    return KeyedBudget(
        settings.max_inflight_bytes, settings.max_inflight_bytes_per_client, "request bodies in flight",
        "from your address", gauge,
    )  # fmt: skip


def answer_budget(settings: Settings, metrics: Metrics | None = None) -> KeyedBudget:
    """The budget of the answers being made or sent (step 4 above)."""
    gauge = metrics.answer_bytes if metrics is not None else None
    return KeyedBudget(
        settings.max_answers_inflight_bytes, settings.max_answers_inflight_bytes_per_client,
        "answers being made or sent", "to your address", gauge,
    )  # fmt: skip
