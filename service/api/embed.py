"""POST /embed (ELMo's layers or mixes of them, per token or pooled) and POST /tokenize (the tokens /embed reads)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import partial

import numpy as np
from fastapi import APIRouter, Request

from service.api import tracing
from service.api.answers import NPZ, Abandoned, Base64, json_response, respond, wants_npz
from service.api.bodies import parsed_off_loop
from service.api.dependencies import model_named, runtime
from service.api.embedding import embedded, observe_parse, offload, reserve_answer, tokenized
from service.api.errors import ERRORS
from service.api.request_id import note
from service.api.schemas import EmbedRequest, EmbedResponse, TokenizeRequest, TokenizeResponse
from service.batching.batcher import Layers
from service.errors import InvalidRequest
from service.mix import compose
from service.models import ServedModel

router = APIRouter(responses=ERRORS, route_class=parsed_off_loop("sentences"))
NPZ_ANSWER = {
    200: {"content": {NPZ: {}}, "description": "with `Accept: application/x-npz`: the answer as an .npz (docs: API)"}
}


@router.post("/embed", response_model=EmbedResponse, responses=NPZ_ANSWER, summary="ELMo vectors of sentences")
async def embed(body: EmbedRequest, request: Request):
    observe_parse(request)
    model = model_named(request, body.model)
    npz = wants_npz(request.headers.get("accept", ""))
    encoding = "npz" if npz else body.encoding
    if body.dtype == "float16" and encoding == "float":  # JSON numbers have no width to halve
        raise InvalidRequest('float16 only with "encoding": "base64" or an .npz answer (Accept: application/x-npz)',
                             "dtype")  # fmt: skip
    output = requested_output(body, model.num_layers)
    sentences, cuts = await tokenized(request, body.sentences, "sentences", body.truncate, model.language,
                                      empty=body.boundaries)  # fmt: skip
    pooled, smaller = body.pooling == "mean", "" if npz else '"encoding": "base64", '  # .npz: the smallest already
    ways_out = f'"pooling": "mean", {smaller}fewer layers or mixes, or fewer sentences per request'
    size = reserve_answer(request, model, sentences, output.count, pooled, encoding, "sentences", ways_out,
                          body.boundaries)  # fmt: skip
    results = await embedded(request, model, sentences, "sentences")
    answer = partial(embed_answer, body, model, output, sentences, results, cuts, encoding)
    numbers = (sum(map(len, sentences)) + 2 * body.boundaries * len(sentences)) * model.dim * output.reads
    # The same request answers JSON or .npz by its Accept header: caches must tell them apart.
    headers = {"vary": "accept"}
    observe = runtime(request).metrics.observe_stage
    with tracing.span(request.app.state.tracer, "elmo.encode", model=model.name, encoding=encoding, bytes=size):
        return await respond(answer, size, npz, observe, headers=headers, numbers=numbers, offload=offload(request))


@dataclass(frozen=True)
class Output:
    """What an /embed request asks of each sentence's layers: mixes (weights, gamma, normalize, layer_norm), or
    layers (their ids; None: all)."""

    mixes: list[tuple[list[float], float, str, bool]]
    layer_ids: list[int] | None
    num_layers: int

    @property
    def count(self) -> int:
        """Vectors per token (or per sentence, pooled) in the answer."""
        return len(self.mixes) or (self.num_layers if self.layer_ids is None else len(self.layer_ids))

    @property
    def reads(self) -> int:
        """Layer vectors per token that composing reads: every layer per mix, or each layer asked for."""
        return self.num_layers * len(self.mixes) or self.count


def requested_output(body: EmbedRequest, num_layers: int) -> Output:
    """The mixes or layers `body` asks for, checked against the model's layers (422 naming the field)."""
    mix_fields = {"weights", "gamma", "normalize", "layer_norm"} & body.model_fields_set
    if body.output == "layers":
        for name in sorted(mix_fields | ({"mixes"} & body.model_fields_set)):
            raise InvalidRequest('only with output "mix"', name)
        ids = body.layers
        for k, layer in enumerate(ids or []):
            if not -num_layers <= layer < num_layers:
                raise InvalidRequest(f"layer {layer} out of range: the model has {num_layers} layers", f"layers[{k}]")
        return Output([], None if ids is None else [layer % num_layers for layer in ids], num_layers)
    if body.layers is not None:
        raise InvalidRequest('only with output "layers"', "layers")
    if body.mixes is not None:
        if mix_fields:
            raise InvalidRequest(f"give either mixes or {', '.join(sorted(mix_fields))}", "mixes")
        specs = [(m, f"mixes[{k}].weights") for k, m in enumerate(body.mixes)]
    else:
        specs = [(body, "weights")]
    mixes = []
    for spec, field in specs:
        weights = [0.0] * num_layers if spec.weights is None else spec.weights
        if len(weights) != num_layers:
            raise InvalidRequest(f"{len(weights)} weights; the model has {num_layers} layers", field)
        mixes.append((weights, spec.gamma, spec.normalize, spec.layer_norm))
    return Output(mixes, None, num_layers)


def embed_answer(
    body: EmbedRequest,
    model: ServedModel,
    output: Output,
    sentences: list[list[str]],
    results: list[Layers],
    cuts: list[dict],
    encoding: str,
    stop: threading.Event | None = None,
) -> dict:
    """The answer of /embed, composed sentence by sentence (Abandoned once `stop` is set: the client has gone).
    With `boundaries`, each sentence's tokens and layers begin and end with the model's boundary tokens."""
    data = []
    begin, end = model.engine.mapping.boundaries
    for i, (tokens, layers, cut) in enumerate(zip(sentences, results, cuts, strict=True)):
        if stop is not None and stop.is_set():
            raise Abandoned
        single_mix = body.mixes is None
        if body.boundaries:
            tokens = [begin, *tokens, end]
        out = compose(layers.result(boundaries=body.boundaries), body.output, output.layer_ids, output.mixes,
                      body.pooling, single_mix, body.unit_length)  # fmt: skip
        half = {}
        if body.dtype == "float16":  # rounded once, after the mix and pooling: half the bytes
            out, half = out.astype(np.float16), {"dtype": "float16"}
        embedding = Base64(out) if encoding == "base64" else out
        data.append({"index": i, "tokens": tokens, "embedding": embedding, "shape": list(out.shape), **half, **cut})
    return {
        "model": model.name,
        "dim": model.dim,
        "num_layers": model.num_layers,
        "data": data,
        "usage": {"sentences": len(sentences), "tokens": sum(map(len, sentences))},
    }


@router.post(
    "/tokenize",
    response_model=TokenizeResponse,
    summary="the tokens /embed reads from the same sentences, and the bytes of each that the model reads",
)
async def tokenize_sentences(body: TokenizeRequest, request: Request):
    model = model_named(request, body.model)
    note(model=model.name)
    sentences, cuts = await tokenized(request, body.sentences, "sentences", body.truncate, model.language)
    mapping = model.engine.mapping
    data = []
    for i, (tokens, cut) in enumerate(zip(sentences, cuts, strict=True)):
        utf8, kept = zip(*(mapping.kept(t) for t in tokens), strict=True)
        uncut = {"truncated": False, "original_tokens": len(tokens)}  # reported with or without truncate
        data.append({"index": i, "tokens": tokens, "utf8_bytes": utf8, "kept_bytes": kept, **uncut, **cut})
    return json_response(
        {
            "model": model.name,
            "max_tokens_per_sentence": runtime(request).settings.max_tokens_per_sentence,
            "max_bytes_per_token": mapping.max_bytes,
            "token_cut": mapping.cut,
            "data": data,
            "usage": {"sentences": len(sentences), "tokens": sum(map(len, sentences))},
        }
    )
