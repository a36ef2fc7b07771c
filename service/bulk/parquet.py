"""elmo-embed's Parquet output: a folder of part files, a row per input line, that pyarrow, pandas, polars, DuckDB
and Spark read as they are.

Columns: `line` (int64, the line's index in the input, from 0), `sentence` (its text: the stripped line, or a .jsonl
line's tokens joined by spaces), `tokens` (list of strings), then the vectors, each a list over the tokens of
fixed-size lists of `dim` floats (float32, or float16 with --dtype float16): `layer_0` ... `layer_{L-1}` with --all
(layer 0 the token layer, layer j `[forward_j; backward_j]`), `top` with --top, `average` with --average. zstd.
Rows come in the order the lines finished (length-sorted batches): sort by `line` for the input's order. The file's
key-value metadata `elmo_embed` names the model and flags (as the hdf5 output's attribute).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROW_GROUP_BYTES = 64 << 20  # the vectors buffered before a row group is written: bounded memory, large reads
PART_FORMAT = "part-{:05d}.parquet"


def vector_columns(layers: str, num_layers: int) -> list[str]:
    """The vector columns' names for elmo-embed's --all / --top / --average."""
    return [f"layer_{j}" for j in range(num_layers)] if layers == "all" else [layers]


def schema(layers: str, num_layers: int, dim: int, dtype: np.dtype, about: str) -> pa.Schema:
    value = pa.float16() if np.dtype(dtype) == np.float16 else pa.float32()
    vectors = pa.list_(pa.list_(value, dim))
    fields = [
        pa.field("line", pa.int64()),
        pa.field("sentence", pa.string()),
        pa.field("tokens", pa.list_(pa.string())),
    ]
    fields += [pa.field(name, vectors) for name in vector_columns(layers, num_layers)]
    return pa.schema(fields, metadata={"elmo_embed": about} if about else None)


class PartWriter:
    """One Parquet part, written row group by row group: `add` a line's layers ((num_layers, n, dim) with --all,
    else (n, dim)), then close (the context manager's exit). The file is created exclusively, never through a link."""

    def __init__(self, path: Path, output, dtype: np.dtype, shape: tuple[int, int]):
        self.layers, self.dtype = output.layers, np.dtype(dtype)
        self.schema = schema(output.layers, shape[0], shape[1], self.dtype, output.about)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        self._file = os.fdopen(fd, "wb")
        self._writer = pq.ParquetWriter(self._file, self.schema, compression="zstd")
        self._rows: list[tuple[int, list[str], str, np.ndarray]] = []
        self._bytes = 0

    def add(self, line: int, tokens: list[str], text: str, layers: np.ndarray) -> None:
        self._rows.append((line, tokens, text, layers))
        self._bytes += layers.nbytes
        if self._bytes >= ROW_GROUP_BYTES:
            self._flush()

    def _flush(self) -> None:
        if not self._rows:
            return
        lines, tokens, texts, layers = zip(*self._rows, strict=True)
        lengths = np.array([len(t) for t in tokens], np.int32)
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        stacked = [np.concatenate(layers, axis=-2)]  # (num_layers, tokens, dim) or (tokens, dim)
        per_column = list(stacked[0]) if self.layers == "all" else stacked
        columns = [pa.array(lines, pa.int64()), pa.array(texts, pa.string()), pa.array(tokens, pa.list_(pa.string()))]
        for vectors in per_column:  # (tokens, dim): one copy into Arrow's buffer, then offsets over it
            flat = pa.array(np.ascontiguousarray(vectors, self.dtype).reshape(-1))
            columns.append(
                pa.ListArray.from_arrays(offsets, pa.FixedSizeListArray.from_arrays(flat, vectors.shape[-1]))
            )
        self._writer.write_table(pa.Table.from_arrays(columns, schema=self.schema))
        self._rows, self._bytes = [], 0

    def __enter__(self) -> PartWriter:
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, trace: TracebackType | None) -> None:
        try:
            if kind is None:
                self._flush()
            self._writer.close()
        finally:
            self._file.close()
