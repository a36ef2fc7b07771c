"""allennlp's character ids of a token (its ELMoCharacterMapper) and back: the token whose ids they are, as the
service reads it. No torch: numpy only.

A token is 50 ids: begin-of-word, the first 48 of its UTF-8 bytes (byte + 1 each), end-of-word, padding; every id
is shifted by one so that 0 means "no token here"; `<S>` and `</S>` are one special id each. The service computes
a token's ids from its text by the same rule (its first 48 UTF-8 bytes), so a text whose UTF-8 bytes begin with
the ids' bytes is read as exactly those ids. The 48 bytes of a long token may end inside a character: then no text
has those bytes alone, and the text sent is those bytes with the character completed (the service reads the first
48 again, the same bytes). Ids that no token has (a byte id above 256, no end of word, bytes that are not UTF-8
short of the cut) are refused, naming the position."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MAX_WORD_LENGTH = 50
MAX_BYTES = MAX_WORD_LENGTH - 2  # begin and end of word around them
BOS_CHAR, EOS_CHAR, BOW_CHAR, EOW_CHAR, PAD_CHAR = 256, 257, 258, 259, 260
SPECIAL = {BOS_CHAR: "<S>", EOS_CHAR: "</S>"}  # tokens written as one special character, as allennlp maps them
# Continuation bytes that complete a character cut after its first bytes: any of 0x80-0xBF follows, except right
# after E0 (A0-BF), ED (80-9F), F0 (90-BF) and F4 (80-8F); one of these three fits each.
COMPLETIONS = (0x80, 0x90, 0xA0)


class InvalidIds(ValueError):
    """Character ids that no token has: `where` is their position, `why` what is wrong."""

    def __init__(self, where: str, why: str):
        super().__init__(f"{where}: {why}")
        self.where, self.why = where, why


def token_ids(token: str) -> list[int]:
    """allennlp's 50 character ids of `token`, shifted by one (0 is padding)."""
    ids = [PAD_CHAR] * MAX_WORD_LENGTH
    special = {text: char for char, text in SPECIAL.items()}.get(token)
    content = [special] if special is not None else list(token.encode("utf-8", "ignore")[:MAX_BYTES])
    ids[0] = BOW_CHAR
    ids[1 : len(content) + 1] = content
    ids[len(content) + 1] = EOW_CHAR
    return [i + 1 for i in ids]


def sentence_tokens(rows: np.ndarray, where: str) -> list[str]:
    """The tokens of one sentence's ids (timesteps, 50): up to its first row of zeros (the batch's padding, after
    which no token may follow). `where` names the sentence in errors, e.g. "inputs[3]"."""
    present = rows.any(axis=-1)
    n = int(present.argmin()) if not present.all() else len(rows)
    if present[n:].any():
        later = n + int(present[n:].argmax())
        raise InvalidIds(f"{where}[{later}]", f"a token after the sentence's end (position {n} is padding)")
    return [token_text(row, f"{where}[{j}]") for j, row in enumerate(rows[:n].tolist())]


def token_text(ids: Sequence[int], where: str) -> str:
    """The text whose character ids are `ids` (50), as the service reads it (see the module's docstring)."""
    chars = [c - 1 for c in ids]
    if len(chars) != MAX_WORD_LENGTH:
        raise InvalidIds(where, f"{len(chars)} character ids; a token has {MAX_WORD_LENGTH}")
    if chars[0] != BOW_CHAR:
        raise InvalidIds(where, f"a token's ids begin with {BOW_CHAR + 1} (begin of word), not {chars[0] + 1}")
    if EOW_CHAR not in chars:
        raise InvalidIds(where, f"no end of word ({EOW_CHAR + 1}) in the token's ids")
    end = chars.index(EOW_CHAR)
    content, rest = chars[1:end], chars[end + 1 :]
    if any(c != PAD_CHAR for c in rest):
        raise InvalidIds(where, f"ids other than padding ({PAD_CHAR + 1}) after the end of word")
    if len(content) == 1 and content[0] in SPECIAL:
        return SPECIAL[content[0]]
    if not_byte := [c + 1 for c in content if not 0 <= c <= 255]:
        raise InvalidIds(where, f"id {not_byte[0]} is not a byte's (1 to 256) nor a lone <S> or </S>")
    data = bytes(content)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        if len(data) == MAX_BYTES and err.reason == "unexpected end of data":  # a long token, cut in a character
            for byte in COMPLETIONS:
                completed = data + bytes([byte]) * (_char_length(data[err.start]) - (len(data) - err.start))
                try:
                    return completed.decode("utf-8")
                except UnicodeDecodeError:
                    continue
        raise InvalidIds(where, f"bytes {data[err.start : err.end]!r} at byte {err.start} are not UTF-8") from None


def _char_length(lead: int) -> int:
    """The bytes of a UTF-8 character that begins with `lead`."""
    return 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
