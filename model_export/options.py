"""The architecture of a biLM, read from (and written to) the published `options.json`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

CHAR_VOCAB = 262  # the published mapping's char ids: 0 (padding) .. 261 (its padding char + 1; service/text/chars.py)


@dataclass(frozen=True)
class BiLMOptions:
    # char-CNN token encoder
    char_dim: int  # char embedding size
    filters: tuple[tuple[int, int], ...]  # (width, number of filters) per convolution
    n_highway: int
    activation: str  # "relu" or "tanh", applied after the max-pool
    n_characters: int  # 261 or 262 in the published files; ids >= 1 are looked up in char_embed
    max_chars: int  # max_characters_per_token
    # LSTM stacks
    n_layers: int
    cell_dim: int  # LSTM cells ("dim")
    proj_dim: int  # projection of each cell output, and of the token vector
    cell_clip: float | None
    proj_clip: float | None
    skip_connections: bool  # residual connection around every layer but the first
    # ELMoForManyLangs' token encoder (model_export/manylangs.py); the published files have neither: the char
    # table is the 262 byte ids, and no word table
    char_vocab: int = CHAR_VOCAB  # rows of the char embedding table (ids 0 .. char_vocab - 1)
    word_vocab: int = 0  # rows of a word embedding table, whose vector joins the char-CNN's before the projection
    word_dim: int = 0

    @property
    def n_filters(self) -> int:
        return sum(n for _, n in self.filters)

    @property
    def output_dim(self) -> int:
        """Size of every output layer: [forward; backward] (layer 0: the token vector twice)."""
        return 2 * self.proj_dim

    @property
    def num_output_layers(self) -> int:
        return self.n_layers + 1

    def macs_by_part(self) -> dict[str, int]:
        """Multiply-adds a token costs in each part (the LSTMs: both directions, the input's and the state's gate
        products and the projection), the measure of work of the benchmarks (bench/yardstick.py)."""
        return {
            "lstm": 2 * self.n_layers * (2 * self.proj_dim * 4 * self.cell_dim + self.cell_dim * self.proj_dim),
            "char_cnn": sum(width * self.char_dim * n * (self.max_chars - width + 1) for width, n in self.filters),
            "highway": self.n_highway * 2 * self.n_filters * self.n_filters,
            "projection": (self.word_dim + self.n_filters) * self.proj_dim,
        }

    def macs_per_token(self) -> int:
        """Multiply-adds per token, all parts together."""
        return sum(self.macs_by_part().values())

    @classmethod
    def from_dict(cls, d: dict) -> BiLMOptions:
        cnn, lstm = d["char_cnn"], d["lstm"]
        if cnn.get("activation", "relu") not in ("relu", "tanh"):
            raise ValueError(f"char_cnn.activation must be relu or tanh, not {cnn['activation']!r}")
        return cls(
            char_dim=int(cnn["embedding"]["dim"]),
            filters=tuple((int(w), int(n)) for w, n in cnn["filters"]),
            n_highway=int(cnn.get("n_highway", 0)),
            activation=cnn.get("activation", "relu"),
            n_characters=int(cnn.get("n_characters", 261)),
            max_chars=int(cnn.get("max_characters_per_token", 50)),
            n_layers=int(lstm.get("n_layers", 2)),
            cell_dim=int(lstm["dim"]),
            proj_dim=int(lstm["projection_dim"]),
            cell_clip=_clip(lstm.get("cell_clip")),
            proj_clip=_clip(lstm.get("proj_clip")),
            skip_connections=bool(lstm.get("use_skip_connections", False)),
            char_vocab=int(cnn.get("char_vocab", CHAR_VOCAB)),
            word_vocab=int(d.get("word_embedding", {}).get("vocab", 0)),
            word_dim=int(d.get("word_embedding", {}).get("dim", 0)),
        )

    def to_dict(self) -> dict:
        """The published `options.json` layout (and, for a model with ELMoForManyLangs' token encoder, its char
        table's size and its word table, which no published file has)."""
        published = {
            "lstm": {
                "n_layers": self.n_layers,
                "dim": self.cell_dim,
                "projection_dim": self.proj_dim,
                "cell_clip": self.cell_clip,
                "proj_clip": self.proj_clip,
                "use_skip_connections": self.skip_connections,
            },
            "char_cnn": {
                "embedding": {"dim": self.char_dim},
                "filters": [list(f) for f in self.filters],
                "n_highway": self.n_highway,
                "activation": self.activation,
                "n_characters": self.n_characters,
                "max_characters_per_token": self.max_chars,
            },
        }
        if self.char_vocab != CHAR_VOCAB:
            published["char_cnn"]["char_vocab"] = self.char_vocab
        if self.word_dim:
            published["word_embedding"] = {"vocab": self.word_vocab, "dim": self.word_dim}
        return published

    def summary(self) -> dict:
        return asdict(self) | {"output_dim": self.output_dim, "num_output_layers": self.num_output_layers}


def _clip(value) -> float | None:
    # The published files use 0/absent for "no clipping" in some versions.
    return float(value) if value else None


def load_options(path: str | Path) -> BiLMOptions:
    return BiLMOptions.from_dict(json.loads(Path(path).read_text()))
