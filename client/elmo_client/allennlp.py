"""allennlp 0.9's `ElmoEmbedder`, backed by the service: code written for allennlp changes one import,

    from allennlp.commands.elmo import ElmoEmbedder   ->   from elmo_client.allennlp import ElmoEmbedder

and gets the same methods and return shapes (`embed_sentence`, `embed_batch`, `embed_sentences`, `embed_file`).
The service computes what it serves, so the model files and the device are the server's: the constructor takes
allennlp's arguments and ignores them, and finds the service at `url`, else $ELMO_URL, else
http://127.0.0.1:8000 (an API key: `api_key`, else $ELMO_API_KEY).

One difference: allennlp's embedder is stateful (each batch starts from the LSTM state the previous one left),
so its vectors depend on what it embedded before; the service is stateless, every sentence starts from the
same state. Its vectors equal allennlp's for the first batch a fresh ElmoEmbedder embeds, and are the same
whenever and with whatever else a sentence is sent. Not here: `batch_to_embeddings`, which returns torch
tensors (this package needs no torch)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import IO

import numpy as np

from elmo_client.client import Client, ElmoError

log = logging.getLogger("elmo_client.allennlp")

# allennlp 0.9's defaults, kept so that calls that pass them positionally or by name still work.
DEFAULT_OPTIONS_FILE = "https://allennlp.s3.amazonaws.com/models/elmo/2x4096_512_2048cnn_2xhighway/elmo_2x4096_512_2048cnn_2xhighway_options.json"
DEFAULT_WEIGHT_FILE = "https://allennlp.s3.amazonaws.com/models/elmo/2x4096_512_2048cnn_2xhighway/elmo_2x4096_512_2048cnn_2xhighway_weights.hdf5"
DEFAULT_BATCH_SIZE = 64


class ConfigurationError(Exception):
    """What allennlp raises for a bad input file (its allennlp.common.checks.ConfigurationError)."""


class ElmoEmbedder:
    def __init__(
        self,
        options_file: str = DEFAULT_OPTIONS_FILE,
        weight_file: str = DEFAULT_WEIGHT_FILE,
        cuda_device: int = -1,
        *,
        url: str | None = None,
        api_key: str | None = None,
        client: Client | None = None,
        timeout: float = 60.0,
        model: str | None = None,
    ) -> None:
        # options_file, weight_file, cuda_device: the server's model and device serve instead; `model`: which of
        # the server's models (None: its default).
        self.client = client or Client(
            url or os.environ.get("ELMO_URL"), api_key or os.environ.get("ELMO_API_KEY"), timeout=timeout
        )
        self.model = model

    def close(self) -> None:
        """Close the client's connections (not in allennlp, whose embedder holds none)."""
        self.client.close()

    def embed_sentence(self, sentence: list[str]) -> np.ndarray:
        """One tokenized sentence -> its layers, (num_layers, n_tokens, dim) (allennlp: (3, n_tokens, 1024))."""
        return self.embed_batch([sentence])[0]

    def embed_batch(self, batch: list[list[str]]) -> list[np.ndarray]:
        """One array (num_layers, n_tokens, dim) per sentence; an empty sentence gets zeros of shape
        (num_layers, 0, dim), float64 as allennlp's empty_embedding()."""
        given = [list(sentence) for sentence in batch if len(sentence) > 0]
        layers = iter(self.client.embed(given, output="layers", model=self.model) if given else [])
        num_layers, dim = self._shape()
        empty = (num_layers, 0, dim)
        return [next(layers) if len(sentence) > 0 else np.zeros(empty) for sentence in batch]

    def _shape(self) -> tuple[int, int]:
        """(num_layers, dim) of the model embedded with: the server's default, or `model` among those it serves."""
        info = self.client.info()
        served = info.get("models")
        if self.model is not None and served is not None:
            if self.model not in served:
                raise ElmoError(f"model: unknown model {self.model!r}; this server serves: {', '.join(served)}", 404)
            info = served[self.model]
        return int(info["num_layers"]), int(info["dim"])

    def embed_sentences(
        self, sentences: Iterable[list[str]], batch_size: int = DEFAULT_BATCH_SIZE
    ) -> Iterator[np.ndarray]:
        """A generator of embed_sentence's arrays, in order. allennlp embeds batch_size sentences at a time;
        here the client sends up to `max_concurrency` such batches at once (the vectors do not depend on it)."""
        sentences = iter(sentences)
        step = batch_size * self.client.max_concurrency
        while batch := list(islice(sentences, step)):
            yield from self.embed_batch(batch)

    def embed_file(
        self,
        input_file: IO,
        output_file_path: str,
        output_format: str = "all",
        batch_size: int = DEFAULT_BATCH_SIZE,
        forget_sentences: bool = False,
        use_sentence_keys: bool = False,
    ) -> None:
        """allennlp's `elmo` command: one whitespace-tokenized sentence per line of `input_file` (an empty line
        is an error) into an hdf5 file (h5py needed: `pip install elmo-client[hdf5]`), one dataset per line
        keyed by its index ("0", "1", ...) or, with use_sentence_keys, by the sentence itself: shape
        (num_layers, n_tokens, dim) for "all", (n_tokens, dim) for "top" (the last layer) and "average" (the
        mean of the layers); and a `sentence_to_index` dataset, a JSON string from sentence to key, unless
        forget_sentences or use_sentence_keys. Closes `input_file` at the end, as allennlp does."""
        import h5py  # optional: only this method writes hdf5

        if output_format not in ("all", "top", "average"):
            raise ConfigurationError(f"output_format must be all, top or average, not {output_format!r}")
        sentences = [line.strip() for line in input_file]
        blank_lines = [i for (i, line) in enumerate(sentences) if line == ""]
        if blank_lines:
            raise ConfigurationError(
                f"Your input file contains empty lines at indexes {blank_lines}. Please remove them."
            )
        split_sentences = [sentence.split() for sentence in sentences]
        embedded = self.embed_sentences(split_sentences, batch_size)
        if use_sentence_keys:
            log.warning("Using sentences as keys can fail if sentences contain forward slashes or colons.")
            keyed = zip(sentences, embedded, strict=True)
        else:
            keyed = ((str(i), x) for i, x in enumerate(embedded))

        sentence_to_index = {}
        with h5py.File(output_file_path, "w") as fout:
            for key, embeddings in keyed:
                if use_sentence_keys and key in fout:
                    raise ConfigurationError(
                        f"Key already exists in {output_file_path}. To encode duplicate sentences, do not pass "
                        "use_sentence_keys."
                    )
                if not forget_sentences and not use_sentence_keys:
                    sentence_to_index[sentences[int(key)]] = key
                if output_format == "all":
                    output = embeddings
                elif output_format == "top":
                    output = embeddings[-1]
                else:
                    output = np.average(embeddings, axis=0)
                fout.create_dataset(str(key), output.shape, dtype="float32", data=output)
            if not forget_sentences and not use_sentence_keys:
                index = fout.create_dataset("sentence_to_index", (1,), dtype=h5py.special_dtype(vlen=str))
                index[0] = json.dumps(sentence_to_index)
        input_file.close()
