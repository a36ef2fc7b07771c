"""POST /embed (ELMo's layers or mixes of them, per token or pooled) and POST /tokenize (the tokens /embed reads)."""

from __future__ import annotations

import threading
from functools import partial

from fastapi import APIRouter, Request

from service.api.answers import NPZ, Abandoned, Base64, json_response, wants_npz
from service.api.bodies import parsed_off_loop
from service.api.dependencies import model_named, runtime
from service.api.embedding import caller, embedder, encoded, observe_parse
from service.api.errors import ERRORS
from service.api.schemas import EmbedRequest, EmbedResponse, TokenizeRequest, TokenizeResponse
from service.embedder import Ask, Embedded, Job
from service.errors import InvalidRequest

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
    smaller = "" if npz else '"encoding": "base64", '  # .npz: the smallest already
    ways_out = f'"pooling": "mean", {smaller}fewer layers or mixes, or fewer sentences per request'
    job = Job(model, body.sentences, "sentences", body.truncate, asked(body, model.num_layers), encoding, ways_out)
    embedded = await embedder(request).embed(job, caller(request))
    # The same request answers JSON or .npz by its Accept header: caches must tell them apart.
    return await encoded(request, partial(embed_answer, embedded), embedded, npz, headers={"vary": "accept"})


def asked(body: EmbedRequest, num_layers: int) -> Ask:
    """What `body` asks of each sentence: the mixes or layers, checked against the model's layers (422 naming the
    field), pooled or not, and how."""
    mix_fields = {"weights", "gamma", "normalize", "layer_norm"} & body.model_fields_set
    how = {"pooling": body.pooling, "unit_length": body.unit_length, "dtype": body.dtype, "boundaries": body.boundaries}
    if body.output == "layers":
        for name in sorted(mix_fields | ({"mixes"} & body.model_fields_set)):
            raise InvalidRequest('only with output "mix"', name)
        ids = body.layers
        for k, layer in enumerate(ids or []):
            if not -num_layers <= layer < num_layers:
                raise InvalidRequest(f"layer {layer} out of range: the model has {num_layers} layers", f"layers[{k}]")
        return Ask(num_layers, "layers", [], None if ids is None else [layer % num_layers for layer in ids], **how)
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
    return Ask(num_layers, "mix", mixes, None, single_mix=body.mixes is None, **how)


def embed_answer(embedded: Embedded, stop: threading.Event | None = None) -> dict:
    """The answer of /embed, composed sentence by sentence (Abandoned once `stop` is set: the client has gone).
    With `boundaries`, each sentence's tokens and layers begin and end with the model's boundary tokens."""
    job, ask, sentences = embedded.job, embedded.job.ask, embedded.sentences
    model, data = job.model, []
    begin, end = model.engine.mapping.boundaries
    for i, (tokens, layers, cut) in enumerate(zip(sentences, embedded.layers, embedded.cuts, strict=True)):
        if stop is not None and stop.is_set():
            raise Abandoned
        if ask.boundaries:
            tokens = [begin, *tokens, end]
        out = ask.vectors(layers)
        half = {"dtype": "float16"} if ask.dtype == "float16" else {}
        embedding = Base64(out) if job.encoding == "base64" else out
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
    job = Job(model, body.sentences, "sentences", body.truncate)
    sentences, cuts = await embedder(request).tokenized(job, caller(request))
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
