"""allennlp's `Elmo` module and `batch_to_ids`, backed by the service: torch code written for allennlp changes
one import (needs torch: `pip install 'elmo-client[torch]'`),

    from allennlp.modules.elmo import Elmo, batch_to_ids   ->   from elmo_client.elmo import Elmo, batch_to_ids

`Elmo(options_file, weight_file, num_output_representations, ...)` called on `batch_to_ids(sentences)` returns
allennlp's dict: "elmo_representations", a list of `num_output_representations` tensors (batch, timesteps, dim),
each its own learned scalar mix of the biLM's layers, and "mask" (batch, timesteps), bool. The service computes
the layers (one request per forward, the layers and not the mix; with the sentence boundaries' vectors where
allennlp's mix sees them: `keep_sentence_boundaries`, `do_layer_norm`); this module mixes them with allennlp's
`ScalarMix` semantics (softmax-normalised weights and gamma, trained with the task unless `scalar_mix_parameters`
fixes them; `do_layer_norm` over the unmasked positions, boundaries included; dropout on each representation), so
gradients reach the mix as in allennlp. Parameter names are allennlp's (`scalar_mix_0.scalar_parameters.0`,
`scalar_mix_0.gamma`), so an allennlp `Elmo`'s state loads (its biLM's keys are ignored, saying so).

What differs (docs/allennlp.md): the biLM is the server's model and is never trained (`requires_grad=True` and
`module` are refused, saying why), and its vectors are stateless (`_elmo_lstm._elmo_lstm.reset_states()` is there,
and has nothing to reset). `vocab_to_cache` and `word_inputs` have allennlp's meaning: the ids' words are sent, and
the server computes their layer 0 as from their characters. Character ids go back to the text the server reads
(elmo_client/char_ids.py): the same ids, so the same vectors, for every token allennlp's `batch_to_ids` makes, a
long one cut inside a character included; ids that no token has are refused, naming the position."""

from __future__ import annotations

import logging
import os
import warnings
from collections import Counter

import numpy as np
import torch

from elmo_client.allennlp import ConfigurationError
from elmo_client.char_ids import MAX_WORD_LENGTH, InvalidIds, sentence_tokens, token_ids
from elmo_client.client import Client

log = logging.getLogger("elmo_client.elmo")
BILM_KEYS = "_elmo_lstm."  # where an allennlp Elmo's state keeps its biLM (the char-CNN and the LSTMs)


def batch_to_ids(batch: list[list[str]]) -> torch.Tensor:
    """allennlp's batch_to_ids: tokenized sentences -> character ids (batch, longest sentence, 50), int64, zeros
    past each sentence's end."""
    ids = torch.zeros((len(batch), max((len(s) for s in batch), default=0), MAX_WORD_LENGTH), dtype=torch.long)
    for i, sentence in enumerate(batch):
        for j, token in enumerate(sentence):
            ids[i, j] = torch.tensor(token_ids(token))
    return ids


def ids_to_tokens(ids: torch.Tensor) -> list[list[str]]:
    """The tokens of character ids (batch, timesteps, 50) as the server reads them: batch_to_ids's inverse where
    the ids are a token's whole (elmo_client/char_ids.py). Ids that no token has: ConfigurationError, naming the
    position (`inputs[i][j]`)."""
    try:
        return [sentence_tokens(row, f"inputs[{i}]") for i, row in enumerate(ids.detach().cpu().numpy())]
    except InvalidIds as err:
        raise ConfigurationError(f"Elmo: {err}: not a token's character ids (as batch_to_ids makes them)") from None


class ScalarMix(torch.nn.Module):
    """allennlp's ScalarMix: gamma * sum_k softmax(w)_k * layer_k, each layer first normalised over the unmasked
    positions (mean and variance of all their numbers) when do_layer_norm."""

    def __init__(
        self,
        mixture_size: int,
        do_layer_norm: bool = False,
        initial_scalar_parameters: list[float] | None = None,
        trainable: bool = True,
    ) -> None:
        super().__init__()
        self.mixture_size, self.do_layer_norm = mixture_size, do_layer_norm
        initial = [0.0] * mixture_size if initial_scalar_parameters is None else initial_scalar_parameters
        if len(initial) != mixture_size:
            raise ConfigurationError(f"Length of initial_scalar_parameters {initial} differs from mixture_size "
                                     f"{mixture_size}")  # fmt: skip
        self.scalar_parameters = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.tensor([float(w)]), requires_grad=trainable) for w in initial]
        )
        self.gamma = torch.nn.Parameter(torch.tensor([1.0]), requires_grad=trainable)

    def forward(self, tensors: list[torch.Tensor], mask: torch.Tensor | None = None) -> torch.Tensor:
        """tensors: mixture_size tensors (batch, timesteps, dim); mask (batch, timesteps), needed for layer norm."""
        if len(tensors) != self.mixture_size:
            raise ConfigurationError(f"{len(tensors)} tensors were passed, but the module was initialized to mix "
                                     f"{self.mixture_size} tensors.")  # fmt: skip
        weights = torch.nn.functional.softmax(torch.cat(list(self.scalar_parameters)), dim=0)
        if self.do_layer_norm:
            assert mask is not None, "do_layer_norm needs the mask"
            broadcast = mask.unsqueeze(-1).to(tensors[0].dtype)
            count = broadcast.sum() * tensors[0].size(-1)
            tensors = [_layer_norm(t, broadcast, count) for t in tensors]
        return self.gamma * sum(w * t for w, t in zip(torch.split(weights, 1), tensors, strict=True))


def _layer_norm(tensor: torch.Tensor, broadcast_mask: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    masked = tensor * broadcast_mask
    mean = masked.sum() / count
    variance = (((masked - mean) * broadcast_mask) ** 2).sum() / count
    tiny = 1e-4 if tensor.dtype == torch.half else 1e-13  # allennlp's tiny_value_of_dtype
    return (tensor - mean) / torch.sqrt(variance + tiny)


class _Stateless:
    """allennlp's ElmoLstm as far as code written for allennlp reaches into it: the served biLM keeps no state
    between batches, so there is none to reset."""

    def reset_states(self) -> None:
        return None


class _ServedBiLm(torch.nn.Module):
    """allennlp's _ElmoBiLm (`Elmo._elmo_lstm`), its layers computed by the server: `forward(inputs, word_inputs)`
    returns {"activations": num_layers tensors (batch, timesteps + 2, dim), "mask": (batch, timesteps + 2)}, the
    sentence boundaries included, as allennlp's. No parameters, no state."""

    def __init__(self, client: Client, model: str | None, num_layers: int, dim: int, vocab: list[str] | None):
        super().__init__()
        self._client, self._model, self.num_layers, self._dim = client, model, num_layers, dim
        self._vocab = vocab
        self._elmo_lstm = _Stateless()

    def get_output_dim(self) -> int:
        return self._dim

    def forward(self, inputs: torch.Tensor, word_inputs: torch.Tensor | None = None) -> dict:
        activations, mask = self.layers(inputs, word_inputs, boundaries=True)
        return {"activations": activations, "mask": mask}

    def layers(
        self, inputs: torch.Tensor, word_inputs: torch.Tensor | None, boundaries: bool
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The server's layers of the batch, zeros past each sentence's end: num_layers tensors (batch, timesteps,
        dim), and the mask (batch, timesteps); with `boundaries`, timesteps + 2 with <S> and </S> in them.
        `inputs`: character ids (batch, timesteps, 50); `word_inputs`: ids (batch, timesteps) of words in
        vocab_to_cache (0: padding), read instead where given and every id is in the vocabulary (else allennlp too
        reads the characters)."""
        sentences = self._words(word_inputs) if word_inputs is not None else None
        source = inputs if sentences is None else word_inputs
        if sentences is None:
            sentences = ids_to_tokens(inputs)
        timesteps = source.shape[1]
        extra = 2 if boundaries else 0
        batch = np.zeros((self.num_layers, len(sentences), timesteps + extra, self._dim), dtype=np.float32)
        mask = torch.zeros((len(sentences), timesteps + extra), dtype=torch.bool)
        # an empty sentence is its two boundaries (allennlp computes them); without them there is nothing to ask
        given = [i for i, s in enumerate(sentences) if s or boundaries]
        asked = [sentences[i] for i in given]
        options = {"boundaries": True} if boundaries else {}
        embedded = self._client.embed(asked, output="layers", model=self._model, **options) if given else []
        for i, layers in zip(given, embedded, strict=True):
            batch[:, i, : layers.shape[1]] = layers
            mask[i, : layers.shape[1]] = True
        return list(torch.from_numpy(batch).to(inputs.device)), mask.to(inputs.device)

    def _words(self, word_inputs: torch.Tensor) -> list[list[str]] | None:
        """The words of vocab_to_cache ids (batch, timesteps), each sentence up to its first 0; None where an id is
        not in the vocabulary."""
        ids = word_inputs.detach().cpu().numpy()
        if self._vocab is None or ids.min(initial=0) < 0 or ids.max(initial=0) >= len(self._vocab):
            return None
        return [[self._vocab[k] for k in row[: _length(row > 0)]] for row in ids]


def _length(present: np.ndarray) -> int:
    """The positions before the first that is not `present`."""
    return len(present) if present.all() else int(present.argmin())


class Elmo(torch.nn.Module):
    """allennlp's Elmo (its signature, its output): see the module's docstring. `url`, `api_key`, `client`,
    `model`, `timeout`: the service, as for elmo_client.Client (default $ELMO_URL, else http://127.0.0.1:8000)."""

    def __init__(
        self,
        options_file: str | None,
        weight_file: str | None,
        num_output_representations: int,
        requires_grad: bool = False,
        do_layer_norm: bool = False,
        dropout: float = 0.5,
        vocab_to_cache: list[str] | None = None,
        keep_sentence_boundaries: bool = False,
        scalar_mix_parameters: list[float] | None = None,
        module: torch.nn.Module | None = None,
        *,
        url: str | None = None,
        api_key: str | None = None,
        client: Client | None = None,
        model: str | None = None,
        timeout: float = 60.0,
    ) -> None:
        super().__init__()
        refused = {
            "requires_grad=True": (requires_grad, "the service's biLM is not trained here: only the mix is"),
            "module": (module is not None, "the biLM is the server's model"),
        }
        for name, (given, why) in refused.items():
            if given:
                raise ConfigurationError(f"Elmo: {name} is not supported by the service's Elmo: {why}")
        for given in (options_file, weight_file):
            if given is not None and "://" not in given and not os.path.exists(given):
                raise FileNotFoundError(f"file {given} not found")  # allennlp's cached_path, in its words
        client = client or Client(
            url or os.environ.get("ELMO_URL"), api_key or os.environ.get("ELMO_API_KEY"), timeout=timeout
        )
        info = client.info()
        if model is not None and info.get("models"):
            info = {**info["models"][model], "model": model}
        num_layers, dim = int(info["num_layers"]), int(info["dim"])
        if options_file is not None or weight_file is not None:
            warnings.warn(f"Elmo: options_file and weight_file are not used: the server at {client.url} "
                          f"computes the layers with its model {info.get('model')!r} ({num_layers} layers of "
                          f"{dim})", UserWarning, stacklevel=2)  # fmt: skip
        vocab = list(vocab_to_cache) if vocab_to_cache is not None else None
        self._elmo_lstm = _ServedBiLm(client, model, num_layers, dim, vocab)
        self._has_cached_vocab = vocab is not None
        self._keep_sentence_boundaries = keep_sentence_boundaries
        # allennlp's mix sees the boundaries whenever it normalises the layers, or keeps them in the output
        self._boundaries = keep_sentence_boundaries or do_layer_norm
        self._dropout = torch.nn.Dropout(p=dropout)
        self._scalar_mixes = []
        for k in range(num_output_representations):
            mix = ScalarMix(num_layers, do_layer_norm, scalar_mix_parameters, scalar_mix_parameters is None)
            self.add_module(f"scalar_mix_{k}", mix)
            self._scalar_mixes.append(mix)

    @property
    def num_layers(self) -> int:
        return self._elmo_lstm.num_layers

    def get_output_dim(self) -> int:
        return self._elmo_lstm.get_output_dim()

    def forward(self, inputs: torch.Tensor, word_inputs: torch.Tensor | None = None) -> dict:
        """inputs: character ids (batch, timesteps, 50) from batch_to_ids (or (..., timesteps, 50)); word_inputs:
        with vocab_to_cache, ids (batch, timesteps) (or (..., timesteps)) of its words. Returns
        {"elmo_representations": [(batch, timesteps, dim)] x num_output_representations, "mask": (batch,
        timesteps) bool} (timesteps + 2 with keep_sentence_boundaries), as allennlp's."""
        shape = inputs.shape
        ids = inputs.reshape(-1, shape[-2], shape[-1]) if len(shape) > 3 else inputs
        words = None
        if word_inputs is not None:
            if not self._has_cached_vocab:
                log.warning("Word inputs were passed to ELMo but it does not have a cached vocab.")  # allennlp's
            else:
                words = word_inputs.reshape(-1, word_inputs.shape[-1]) if word_inputs.dim() > 2 else word_inputs
        layers, mask = self._elmo_lstm.layers(ids, words, self._boundaries)
        representations = []
        for mix in self._scalar_mixes:
            mixed = mix(layers, mask)
            if self._keep_sentence_boundaries:
                out, out_mask = mixed, mask
            elif self._boundaries:  # allennlp's remove_sentence_boundaries: token j at j, zeros past the end
                out_mask = mask[:, 2:].clone()
                out = mixed[:, 1:-1] * out_mask.unsqueeze(-1)
            else:  # allennlp leaves zeros past the end
                out, out_mask = mixed * mask.unsqueeze(-1), mask
            representations.append(self._dropout(out))
        lead, size = word_inputs.shape[:-1] if words is not None else shape[:-2], out_mask.shape[-1]
        return {
            "elmo_representations": [r.reshape(*lead, size, -1) for r in representations],
            "mask": out_mask.reshape(*lead, size),
        }

    def load_state_dict(self, state_dict, strict: bool = True, *args, **kwargs):
        """allennlp's Elmo state loads: its mixes; its biLM's keys (`_elmo_lstm.*`, the server's model here) are
        ignored, with a warning that names them."""
        bilm = [key for key in state_dict if key.startswith(BILM_KEYS)]
        if bilm:
            parts = Counter(".".join(key.split(".")[:2]) for key in bilm)
            listed = ", ".join(f"{part}.* ({n})" for part, n in parts.items())
            warnings.warn(f"Elmo: {len(bilm)} keys of allennlp's biLM ignored, {listed}: the biLM is the server's "
                          "model", UserWarning, stacklevel=2)  # fmt: skip
            state_dict = {key: value for key, value in state_dict.items() if not key.startswith(BILM_KEYS)}
        return super().load_state_dict(state_dict, strict, *args, **kwargs)
