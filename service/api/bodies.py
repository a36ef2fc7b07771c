"""Large JSON bodies parsed and validated off the event loop, their counts checked before their items are built.

FastAPI parses a body with `json.loads` and validates it with pydantic on the event loop, each in one call that
holds the GIL from start to end: an 8 MB body of 2.8 M empty lists cost 2.6 s of the loop (and 337 MB) before the
sentence limit refused it, and /health/live waited as long. A thread alone does not help: a C call that holds the
GIL blocks the loop's thread all the same. So a body over INLINE_BYTES is read here, on a thread, piece by piece
(`json`'s own scanner, one value at a time: the GIL changes hands between pieces), and

- an array is refused as soon as it holds one item too many (the counted field, `sentences` or `input`, at
  `max_sentences`), and the body as soon as it holds more lists and objects than any request can need, before the
  rest is built;
- the counted field's items are validated one by one, and a long list in slices, so that pydantic too holds the
  GIL only for short spells; the model is then handed to FastAPI, which takes an instance as it is.

Errors are FastAPI's own: invalid JSON and invalid fields the same 422 as before, a count the same 413 the
admission step gives. A body up to INLINE_BYTES costs the loop about a millisecond and is left to FastAPI."""

from __future__ import annotations

import email.message
import json
import re
import threading
from typing import Annotated, Any

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import ConfigDict, TypeAdapter, ValidationError

from service.api.cancellation import Abandoned, off_loop
from service.api.dependencies import runtime
from service.api.schemas import Tokens
from service.errors import TooLarge

INLINE_BYTES = 16 << 10  # parsed on the loop by FastAPI: about 1 ms of it at most
WINDOW = 64 << 10  # a list or object that ends within this many characters is read in one call
SLICE = 4096  # items validated per call
MAX_DEPTH = 8  # no field of the API nests deeper than 4 (mixes[k].weights[j])
# Lists and objects a request may hold besides its sentences: the root, `layers`, `weights`, `mixes` and each of
# its (at most 8) objects and their weights, with room to spare.
OTHER_CONTAINERS = 64
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()
_ITEM = TypeAdapter(Tokens | str, config=ConfigDict(strict=True))
_TOKENS = TypeAdapter(list[str], config=ConfigDict(strict=True))


class _Parser:
    """A JSON text read one value at a time, with counts bounded: what json.loads would return, or TooLarge."""

    def __init__(self, text: str, counted: str, max_items: int, stop: threading.Event, caps: dict | None = None):
        self.text, self.counted, self.max_items, self.stop = text, counted, max_items, stop
        self.caps = caps or {}  # the body's other list fields: their TypeAdapter with the field's max_length
        self.containers_left = max_items + OTHER_CONTAINERS
        self.no_run_until = 0

    def document(self) -> Any:
        value, end = self.value(_skip(self.text, 0), 0, "body")
        end = _skip(self.text, end)
        if end != len(self.text):
            raise json.JSONDecodeError("Extra data", self.text, end)
        return value

    def value(self, i: int, depth: int, path: str) -> tuple[Any, int]:
        text = self.text
        if i >= len(text) or text[i] not in "[{":
            return _DECODER.raw_decode(text, i)  # a string, number or literal: in one call, whatever its length
        if depth >= MAX_DEPTH:
            # json.loads' own answer to nesting past its recursion limit (no field nests deeper than 4)
            raise RecursionError(f"{path}: nested deeper than {MAX_DEPTH} lists and objects")
        try:  # small (a sentence of tokens, a mix): one call of the C scanner, bounded by the window
            value, end = _DECODER.raw_decode(text[i : i + WINDOW])
        except (json.JSONDecodeError, RecursionError):
            pass  # longer than the window (or invalid): piece by piece, where an error names its place
        else:
            counted = value if path == self.counted else None
            if path == "body" and type(value) is dict:
                counted = value.get(self.counted)
            if type(counted) is list and len(counted) > self.max_items:
                raise TooLarge(f"{len(counted)} sentences; the limit is {self.max_items} per request", self.counted)
            fields = value if path == "body" and type(value) is dict else {path: value}
            for name, cap in self.caps.items():
                if type(field := fields.get(name)) is list and len(field) > cap[0]:
                    _too_long(cap, field, name)
            self.count(_containers(value), path)
            return value, i + end
        self.count(1, path)
        return self.array(i, depth, path) if text[i] == "[" else self.object(i, depth, path)

    def count(self, containers: int, path: str) -> None:
        self.containers_left -= containers
        if self.containers_left < 0:
            field = path.partition("[")[0]
            raise TooLarge(
                f"more than {self.max_items + OTHER_CONTAINERS} lists and objects; a request holds at most "
                f"{self.max_items} sentences (one list each) and a few fields",
                self.counted if field == "body" else field,
            )

    def array(self, i: int, depth: int, path: str) -> tuple[list, int]:
        text, items = self.text, []
        limit = self.max_items if path == self.counted else None
        cap = self.caps.get(path)
        i = _skip(text, i + 1)
        if text.startswith("]", i):
            return items, i + 1
        while True:
            if limit is not None and len(items) >= limit:  # counted before the next item is built
                raise TooLarge(f"more than {limit} sentences; the limit is {limit} per request", self.counted)
            if cap is not None and len(items) > cap[0]:
                _too_long(cap, items, path)
            if self.stop.is_set():
                raise Abandoned
            if (run := self.run(i, path)) is not None:  # many items at once: numbers, tokens, texts
                values, i = run
                items += values
                continue
            item, i = self.value(i, depth + 1, f"{path}[{len(items)}]")
            items.append(item)
            i = _skip(text, i)
            if text.startswith(",", i):
                i = _skip(text, i + 1)
            elif text.startswith("]", i):
                return items, i + 1
            else:
                raise json.JSONDecodeError("Expecting ',' delimiter", text, i)

    def run(self, i: int, path: str) -> tuple[list, int] | None:
        """The items of an array from `i` up to its last comma within the window, read in one call as an array of
        their own, and where the next item starts; None where that is not a run of whole items (the window ends
        in a string or a nested list: the decode fails) or there is no comma. A long list of numbers or tokens
        costs a call per window instead of one per item."""
        text = self.text
        if i >= len(text) or i < self.no_run_until or text[i] in "[{":
            return None  # past the end (a body cut after a comma): value() names what is missing, and where
        # The last comma, or the last after a closing quote (a comma inside a text is not one between items)
        for end in (text.rfind(",", i, i + WINDOW), text.rfind('",', i, i + WINDOW) + 1):
            if end <= i:
                continue
            try:
                chunk = "[" + text[i:end] + "]"
                values, used = _DECODER.raw_decode(chunk)
            except (json.JSONDecodeError, RecursionError):
                continue
            if used == len(chunk):
                self.count(_containers(values) - 1, path)
                return values, _skip(text, end + 1)
        self.no_run_until = i + WINDOW  # item by item through this window (an error, or commas in odd places)
        return None

    def object(self, i: int, depth: int, path: str) -> tuple[dict, int]:
        text, members = self.text, {}
        i = _skip(text, i + 1)
        if text.startswith("}", i):
            return members, i + 1
        while True:
            if not text.startswith('"', i):
                raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, i)
            name, i = _DECODER.raw_decode(text, i)
            i = _skip(text, i)
            if not text.startswith(":", i):
                raise json.JSONDecodeError("Expecting ':' delimiter", text, i)
            members[name], i = self.value(_skip(text, i + 1), depth + 1, name if path == "body" else path)
            i = _skip(text, i)
            if text.startswith(",", i):
                i = _skip(text, i + 1)
            elif text.startswith("}", i):
                return members, i + 1
            else:
                raise json.JSONDecodeError("Expecting ',' delimiter", text, i)


def _caps(field, counted: str) -> dict:
    """The body's list fields with a max_length (besides the counted one): name -> (max_length, a validator of
    the field alone, as FastAPI's ModelField)."""
    caps = {}
    model = field.field_info.annotation
    for name, info in getattr(model, "model_fields", {}).items():
        most = next((m.max_length for m in info.metadata if getattr(m, "max_length", None) is not None), None)
        if most is not None and name != counted:
            caps[name] = (most, TypeAdapter(Annotated[info.annotation, info], config=ConfigDict(strict=True)))
    return caps


def _too_long(cap: tuple, items: list, path: str) -> None:
    """A list field with one item too many: pydantic's own error for it, from those (not from all of them)."""
    try:
        cap[1].validate_python(items[: cap[0] + 1])
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", path, *e["loc"])} for e in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None


def _containers(value: Any) -> int:
    """The lists and objects in `value`, itself included (a sentence of tokens: one)."""
    if type(value) is list:
        return 1 + sum(_containers(x) for x in value if type(x) in (list, dict))
    if type(value) is dict:
        return 1 + sum(_containers(x) for x in value.values() if type(x) in (list, dict))
    return 0


def _skip(text: str, i: int) -> int:
    return _WHITESPACE.match(text, i).end()


def _validated(field, body: Any, counted: str, stop: threading.Event) -> Any:
    """`body` validated as FastAPI would validate it (RequestValidationError with its errors, in pydantic's order),
    the counted field's items one by one and long lists in slices, so that no pydantic call holds the GIL for
    long."""
    items = body.get(counted) if isinstance(body, dict) else None
    if not (isinstance(items, list) and items and counted == "sentences"):
        value, errors = field.validate(body, {}, loc=("body",))
        if errors:
            raise RequestValidationError(errors, body=body)
        return value
    # the rest of the body first, with one valid sentence in place of the many
    value, errors = field.validate({**body, counted: [""]}, {}, loc=("body",))
    kept = []
    for k, item in enumerate(items):
        if stop.is_set():
            raise Abandoned
        if (
            isinstance(item, list)
            and len(item) > SLICE
            and all(_ok(_TOKENS, item[j : j + SLICE]) for j in range(0, len(item), SLICE))
        ):
            kept.append(item)  # every slice a list of strings: the whole is
            continue
        try:
            kept.append(_ITEM.validate_python(item))
        except ValidationError as exc:  # the list stops at its first wrong item (fail_fast), as pydantic's does
            errors += [{**e, "loc": ("body", counted, k, *e["loc"])} for e in exc.errors(include_url=False)]
            break
    if errors:
        order = list(field.field_info.annotation.model_fields)  # pydantic reports fields in this order, then extras
        errors.sort(key=lambda e: order.index(e["loc"][1]) if e["loc"][1:2] and e["loc"][1] in order else len(order))
        raise RequestValidationError(errors, body=body)
    setattr(value, counted, kept)
    return value


def _ok(adapter: TypeAdapter, value: Any) -> bool:
    try:
        adapter.validate_python(value)
    except ValidationError:
        return False
    return True


def _is_json(request: Request) -> bool:
    """Whether FastAPI would read this body as JSON (its own test of the Content-Type)."""
    declared = request.headers.get("content-type")
    if declared is None:
        return False  # FastAPI reads it as JSON too (not strict about the type): small or large, left to it
    message = email.message.Message()
    message["content-type"] = declared
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


class _Parsed(Request):
    """A request whose JSON body was already read (and validated) off the loop."""

    parsed: Any = None

    async def json(self) -> Any:
        return self.parsed if self.parsed is not None else await super().json()


def parsed_off_loop(counted: str) -> type[APIRoute]:
    """The route class of a router whose bodies count their items in `counted` (sentences, or input)."""

    class OffLoopRoute(APIRoute):
        def get_route_handler(self):
            handle = super().get_route_handler()
            field = self.body_field
            caps = _caps(field, counted) if field is not None else {}

            async def handler(request: Request):
                request = _Parsed(request.scope, request.receive)
                body = await request.body()
                if field is not None and len(body) > INLINE_BYTES and _is_json(request):
                    parts = runtime(request)
                    work = _parse_work(body, field, counted, parts.settings.max_sentences, caps)
                    request.parsed = await off_loop(request, parts.parse_pool, work)
                return await handle(request)

            return handler

    return OffLoopRoute


def _parse_work(body: bytes, field, counted: str, max_items: int, caps: dict):
    def parse(stop: threading.Event) -> Any:
        try:
            text = body.decode(json.detect_encoding(body), "surrogatepass")  # as json.loads decodes bytes
        except UnicodeDecodeError as exc:
            raise HTTPException(400, "There was an error parsing the body") from exc  # as FastAPI answers it
        try:
            document = _Parser(text, counted, max_items, stop, caps).document()
        except json.JSONDecodeError as exc:  # as FastAPI reports it
            error = {"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error", "input": {}}
            raise RequestValidationError([{**error, "ctx": {"error": exc.msg}}], body=exc.doc) from None
        except RecursionError as exc:
            raise HTTPException(400, "There was an error parsing the body") from exc
        return _validated(field, document, counted, stop)

    return parse
