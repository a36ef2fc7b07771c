"""allennlp 0.9's `ElmoEmbedder`, backed by the service: code written for allennlp changes one import,

    from allennlp.commands.elmo import ElmoEmbedder   ->   from elmo_client.allennlp import ElmoEmbedder

and gets the same methods and return shapes (`embed_sentence`, `embed_batch`, `embed_sentences`, `embed_file`),
and `main`, the `allennlp elmo` command's entry point. The service computes what it serves, so the model and
the device are the server's: the constructor takes allennlp's arguments, refuses a model file that does not
exist (as allennlp does, in its words), and warns once, naming the server's model, that the files and the
device given are not used. It finds the service at `url`, else $ELMO_URL, else http://127.0.0.1:8000 (an API
key: `api_key`, else $ELMO_API_KEY).

The differences (docs/allennlp.md):
- allennlp's embedder is stateful (each batch starts from the LSTM state the previous one left), so its vectors
  depend on what it embedded before; the service is stateless, every sentence starts from the same state. Its
  vectors equal allennlp's for the first batch a fresh ElmoEmbedder embeds, and are the same whenever and with
  whatever else a sentence is sent.
- An empty sentence's array is zeros of (num_layers, 0, dim), the server model's shape, where allennlp's is
  (3, 0, 1024) whatever the model.
- A sentence over the server's max_tokens_per_sentence is refused before anything is sent (ElmoError, 413),
  saying what to do; allennlp embeds any length.
- Not here: `batch_to_embeddings`, which returns torch tensors (`elmo_client.elmo`, the torch extra, has the
  Elmo module and batch_to_ids)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import IO

import numpy as np

from elmo_client.chunks import Limits
from elmo_client.client import Client, ElmoError

log = logging.getLogger("elmo_client.allennlp")

# allennlp 0.9's defaults, kept so that calls that pass them positionally or by name still work.
DEFAULT_OPTIONS_FILE = "https://allennlp.s3.amazonaws.com/models/elmo/2x4096_512_2048cnn_2xhighway/elmo_2x4096_512_2048cnn_2xhighway_options.json"
DEFAULT_WEIGHT_FILE = "https://allennlp.s3.amazonaws.com/models/elmo/2x4096_512_2048cnn_2xhighway/elmo_2x4096_512_2048cnn_2xhighway_weights.hdf5"
DEFAULT_BATCH_SIZE = 64

try:  # code written for allennlp catches allennlp's class: where allennlp is installed, ours is one of them
    from allennlp.common.checks import ConfigurationError as _AllennlpConfigurationError
except Exception:  # not installed, or its import fails (allennlp 2.x imports transformers, spacy, ...)
    _AllennlpConfigurationError = Exception


class ConfigurationError(_AllennlpConfigurationError):
    """What allennlp raises for a bad input file: a subclass of allennlp.common.checks.ConfigurationError when
    allennlp is importable, so that `except` clauses written for allennlp catch it."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message  # as allennlp's

    def __str__(self) -> str:
        return self.message


class ElmoEmbedder:
    def __init__(
        self,
        options_file: str | None = None,
        weight_file: str | None = None,
        cuda_device: int | None = None,
        *,
        url: str | None = None,
        api_key: str | None = None,
        client: Client | None = None,
        timeout: float = 60.0,
        model: str | None = None,
    ) -> None:
        # options_file, weight_file, cuda_device: the server's model and device serve instead (a warning says so
        # at the first embedding, naming it); `model`: which of the server's models (None: its default).
        for given in (options_file, weight_file):
            if given is not None and "://" not in given and not os.path.exists(given):
                raise FileNotFoundError(f"file {given} not found")  # allennlp's cached_path, in its words
        self._ignored = [f"{name}={value!r}" for name, value in
                         (("options_file", options_file), ("weight_file", weight_file), ("cuda_device", cuda_device))
                         if value is not None]  # fmt: skip
        self.client = client or Client(
            url or os.environ.get("ELMO_URL"), api_key or os.environ.get("ELMO_API_KEY"), timeout=timeout
        )
        self.model = model

    def close(self) -> None:
        """Close the client's connections (not in allennlp, whose embedder holds none); or use `with`."""
        self.client.close()

    def __enter__(self) -> ElmoEmbedder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def embed_sentence(self, sentence: list[str]) -> np.ndarray:
        """One tokenized sentence -> its layers, (num_layers, n_tokens, dim) (allennlp: (3, n_tokens, 1024))."""
        return self.embed_batch([sentence])[0]

    def embed_batch(self, batch: list[list[str]]) -> list[np.ndarray]:
        """One array (num_layers, n_tokens, dim) per sentence; an empty sentence gets zeros of shape
        (num_layers, 0, dim), float64 as allennlp's empty_embedding() (whose shape is (3, 0, 1024) whatever the
        model: here the server model's layers and dim)."""
        num_layers, dim = self._shape()
        given = [list(sentence) for sentence in batch if len(sentence) > 0]
        self._check_lengths(given)
        layers = iter(self.client.embed(given, output="layers", model=self.model) if given else [])
        empty = (num_layers, 0, dim)
        return [next(layers) if len(sentence) > 0 else np.zeros(empty) for sentence in batch]

    def _shape(self) -> tuple[int, int]:
        """(num_layers, dim) of the model embedded with: the server's default, or `model` among those it serves.
        The first time, the warning that allennlp's model files and device are not used."""
        info = self.client.info()
        served = info.get("models")
        if self.model is not None and served is not None:
            if self.model not in served:
                raise ElmoError(f"model: unknown model {self.model!r}; this server serves: {', '.join(served)}", 404)
            info = {**served[self.model], "model": self.model}
        if self._ignored:
            warnings.warn(
                f"ElmoEmbedder: {', '.join(self._ignored)} not used: the server at {self.client.url} embeds with "
                f"its model {info.get('model', self.model)!r} ({info['num_layers']} layers of {info['dim']}) on its "
                "own device",
                UserWarning,
                stacklevel=3,
            )
            self._ignored = []
        return int(info["num_layers"]), int(info["dim"])

    def _check_lengths(self, sentences: list[list[str]]) -> None:
        """Refuse, before sending anything, a sentence the server would refuse (413) for its length."""
        limit = Limits.from_info(self.client.info()).max_tokens_per_sentence
        for sentence in sentences:
            if len(sentence) > limit:
                raise ElmoError(
                    f"a sentence of {len(sentence)} tokens ({' '.join(sentence[:5])} ...) is over this server's "
                    f"max_tokens_per_sentence, {limit}: split it into sentences (the service's vectors are of "
                    "whole sentences, and a piece's differ from the whole's near the cut), or raise the server's "
                    "ELMO_MAX_TOKENS_PER_SENTENCE",
                    413,
                )

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


def main(argv: list[str] | None = None) -> None:
    """allennlp 0.9's `allennlp elmo` command, with the service as the model: `python -m elmo_client.allennlp elmo
    INPUT OUTPUT --all` (argv: allennlp's, sys.argv by default: the program, "elmo", then the command's
    arguments). Raises what allennlp's raises (ConfigurationError for an empty line)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="allennlp", description="allennlp's elmo command against the service")
    commands = parser.add_subparsers(dest="command", required=True)
    elmo = commands.add_parser("elmo", description="Create word vectors using ELMo (the service's model).")
    elmo.add_argument("input_file", type=argparse.FileType("r", encoding="utf-8"))
    elmo.add_argument("output_file", type=str)
    group = elmo.add_mutually_exclusive_group(required=True)
    for flag in ("all", "top", "average"):
        group.add_argument(f"--{flag}", dest="output_format", action="store_const", const=flag)
    elmo.add_argument("--vocab-path", help="ignored, as in allennlp 0.9")
    elmo.add_argument("--options-file", default=None)
    elmo.add_argument("--weight-file", default=None)
    elmo.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    elmo.add_argument("--file-friendly-logging", action="store_true")
    elmo.add_argument("--cuda-device", type=int, default=None)
    elmo.add_argument("--forget-sentences", action="store_true")
    elmo.add_argument("--use-sentence-keys", action="store_true")
    args = parser.parse_args(argv)
    with ElmoEmbedder(args.options_file, args.weight_file, args.cuda_device) as embedder:
        embedder.embed_file(args.input_file, args.output_file, args.output_format, args.batch_size,
                            args.forget_sentences, args.use_sentence_keys)  # fmt: skip


if __name__ == "__main__":
    main()
