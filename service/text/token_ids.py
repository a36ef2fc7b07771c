"""Token -> the ints the graph reads, by model family; the manifest says which (`token_mapping`).

Two families of ELMo exist, and they read a token differently:

* `bilm-tf` (allennlp's, bilm-tf's and NLPL's models): a token is its UTF-8 bytes, cut to max_chars - 2 (the
  byte ids of service/text/chars.py, the same for every model); `<S>` and `</S>` wrap each sentence.
* `elmoformanylangs` (HIT-SCIR's 44 languages): a token is its Unicode characters, cut to max_chars - 2, each
  looked up in the model's own `char.dic` (an unknown one is `<oov>`), and the token itself in its `word.dic`
  (a learned word vector joins the char-CNN's before the projection); `<bos>` and `<eos>` wrap each sentence.

A row is what the graph's `token_chars` input holds for one token: max_chars char ids, then the word id for a
model with a word table. A `key` is what a token's row depends on and nothing more, so tokens with equal keys
have equal rows and equal vectors (the engine's token cache is keyed by it).
"""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path

import numpy as np

from service.text.chars import BOS_TOKEN, EOS_TOKEN, char_key, key_char_ids, token_bytes

BILM_TF = "bilm-tf"
ELMOFORMANYLANGS = "elmoformanylangs"


class BilmTfMapping:
    """The published byte mapping (service/text/chars.py)."""

    family = BILM_TF

    def __init__(self, max_chars: int):
        self.max_chars = max_chars
        self.width = max_chars
        self.boundaries = (BOS_TOKEN, EOS_TOKEN)
        self.cut = f"the first {max_chars - 2} UTF-8 bytes"
        self.max_bytes = max_chars - 2  # what a token's row keeps of it, at most

    def key(self, token: str) -> Hashable:
        return char_key(token, self.max_chars)

    def row(self, key: Hashable) -> np.ndarray:
        return key_char_ids(key, self.max_chars)

    def kept(self, token: str) -> tuple[int, int]:
        """The token's UTF-8 bytes, and how many of them its row keeps."""
        return token_bytes(token, self.max_chars)


class ManyLangsMapping:
    """ELMoForManyLangs' mapping, as its package (elmoformanylangs 0.0.4) feeds its models, quirks included."""

    family = ELMOFORMANYLANGS

    def __init__(self, chars: dict[str, int], words: dict[str, int] | None, max_chars: int):
        for name in ("<bow>", "<eow>", "<oov>", "<pad>", "<bos>", "<eos>"):
            if name not in chars:
                raise ValueError(f"char.dic has no {name}: not an ELMoForManyLangs model")
        if words is not None and not {"<oov>", "<pad>"} <= words.keys():
            raise ValueError("word.dic has no <oov> or <pad>: not an ELMoForManyLangs model")
        self.chars, self.words, self.max_chars = chars, words, max_chars
        self.width = max_chars + (words is not None)
        self.boundaries = ("<bos>", "<eos>")
        self.cut = f"the first {max_chars - 2} characters"
        self.max_bytes = None  # characters are kept, whatever their bytes
        # The package reads '<eow>' into its begin-of-word id and '<bow>' into its end-of-word id (frontend.py and
        # biLM.py, create_one_batch), and its models were trained so: each word starts with <eow>'s id.
        self._begin, self._end = chars["<eow>"], chars["<bow>"]

    def key(self, token: str) -> Hashable:
        # The package cuts a long token to its first max_chars - 2 characters before both lookups (read_list).
        return token[: self.max_chars - 2]

    def row(self, key: Hashable) -> np.ndarray:
        row = np.full(self.width, self.chars["<pad>"], dtype=np.int32)
        row[0] = self._begin
        if key in self.boundaries:  # a token spelled <bos> or <eos> is the boundary to the package too
            inside = [self.chars[key]]
        else:
            oov = self.chars["<oov>"]
            inside = [self.chars.get(c, oov) for c in key]
        row[1 : len(inside) + 1] = inside
        row[len(inside) + 1] = self._end
        if self.words is not None:
            row[-1] = self.words.get(key, self.words["<oov>"])
        return row

    def kept(self, token: str) -> tuple[int, int]:
        """The token's UTF-8 bytes, and how many of them (its first characters') its row keeps."""
        utf8 = token.encode("utf-8", "ignore")
        return len(utf8), len(token[: self.max_chars - 2].encode("utf-8", "ignore"))


def read_dictionary(path: Path) -> dict[str, int]:
    """char.dic / word.dic as the package reads them: `entry<TAB>id` per line (lines end wherever
    str.splitlines ends them, as its codecs.open reader does: also at \\x1c, \\x85, \\u2028...), the line stripped
    first; a line left with one field is U+3000 (the ideographic space, which the strip took away); a later line
    wins."""
    table = {}
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        fields = line.strip().split("\t")
        if len(fields) == 1:
            fields.insert(0, "\u3000")
        if len(fields) != 2 or not fields[1].lstrip("-").isdigit():
            raise ValueError(f"{path}:{number}: not `entry<TAB>id`")
        table[fields[0]] = int(fields[1])
    return table


Mapping = BilmTfMapping | ManyLangsMapping


def load_mapping(model_dir: str | Path, manifest: dict) -> Mapping:
    """The mapping a model folder's manifest names (a manifest without one is bilm-tf's)."""
    max_chars = int(manifest["architecture"]["char_cnn"]["max_characters_per_token"])
    spec = manifest.get("token_mapping", {"family": BILM_TF})
    if spec["family"] == BILM_TF:
        return BilmTfMapping(max_chars)
    if spec["family"] == ELMOFORMANYLANGS:
        chars = read_dictionary(Path(model_dir) / spec["chars"])
        words = read_dictionary(Path(model_dir) / spec["words"]) if spec.get("words") else None
        return ManyLangsMapping(chars, words, max_chars)
    raise ValueError(f"unknown token_mapping family {spec['family']!r}: export it again with elmo-export")
