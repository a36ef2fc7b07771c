"""OpenAI's embeddings API, so that OpenAI's clients and LangChain work unchanged: POST /v1/embeddings (one vector
per input: the mean-pooled average of the layers) and GET /v1/models. Errors under /v1/ come in OpenAI's shape
(service/api/errors.py)."""

from __future__ import annotations

import threading
from functools import partial

from fastapi import APIRouter, Request

from service.api.answers import Abandoned, Base64, json_response
from service.api.bodies import parsed_off_loop
from service.api.dependencies import model_named, registry
from service.api.embedding import caller, embedder, encoded, observe_parse
from service.api.errors import OPENAI_ERRORS
from service.api.schemas import ModelList, ModelObject, OpenAIEmbeddingRequest, OpenAIEmbeddingResponse
from service.embedder import Ask, Embedded, Job
from service.errors import InvalidRequest
from service.models import ServedModel

router = APIRouter(prefix="/v1", route_class=parsed_off_loop("input"))


@router.post(
    "/embeddings",
    response_model=OpenAIEmbeddingResponse,
    responses=OPENAI_ERRORS,
    summary="OpenAI-style: one vector per input (mean-pooled average of the layers)",
)
async def openai_embeddings(body: OpenAIEmbeddingRequest, request: Request):
    observe_parse(request)
    model = model_named(request, body.model)
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:
        raise InvalidRequest("empty list", "input")
    if body.dimensions is not None and body.dimensions != model.dim:  # ignoring it would hand back the wrong size
        raise InvalidRequest(f"{body.dimensions} asked for; this model's vectors have {model.dim}", "dimensions")
    ways_out = '"encoding_format": "base64", or fewer inputs per request'
    job = Job(model, texts, "input", body.truncate, averaged(model.num_layers, body.unit_length), body.encoding_format,
              ways_out)  # fmt: skip
    embedded = await embedder(request).embed(job, caller(request))
    return await encoded(request, partial(openai_answer, embedded), embedded)


def averaged(num_layers: int, unit_length: bool) -> Ask:
    """What /v1/embeddings asks of each input: the mean-pooled average of the layers (the mix with equal weights)."""
    equal = ([0.0] * num_layers, 1.0, "softmax", False)  # weights 0, softmaxed: 1 / num_layers each
    return Ask(num_layers, "mix", [equal], pooling="mean", unit_length=unit_length)


def openai_answer(embedded: Embedded, stop: threading.Event | None = None) -> dict:
    """The answer of /v1/embeddings: each input's vector (`averaged`)."""
    job, data = embedded.job, []
    for i, (layers, cut) in enumerate(zip(embedded.layers, embedded.cuts, strict=True)):
        if stop is not None and stop.is_set():
            raise Abandoned
        vector = job.ask.vectors(layers)
        embedding = Base64(vector) if job.encoding == "base64" else vector
        data.append({"object": "embedding", "index": i, "embedding": embedding, **cut})
    tokens = sum(map(len, embedded.sentences))
    return {
        "object": "list",
        "data": data,
        "model": job.model.name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


@router.get(
    "/models",
    response_model=ModelList,
    responses={code: OPENAI_ERRORS[code] for code in (401, 503)},
    summary="OpenAI-style: the models served, the default first",
)
async def list_models(request: Request):
    return json_response({"object": "list", "data": [model_object(m) for m in registry(request)]})


@router.get(
    "/models/{model_id}",
    response_model=ModelObject,
    responses={code: OPENAI_ERRORS[code] for code in (401, 404, 503)},
    summary="OpenAI-style: one model served",
)
async def retrieve_model(model_id: str, request: Request):
    return json_response(model_object(model_named(request, model_id)))


def model_object(model: ServedModel) -> dict:
    """A model as OpenAI's /v1/models lists one, with its shape."""
    return {
        "id": model.name,
        "object": "model",
        "created": model.created,
        "owned_by": "elmo-service",
        "dim": model.dim,
        "num_layers": model.num_layers,
    }
