"""Request and response bodies of the HTTP API (they are also its OpenAPI document)."""

from __future__ import annotations

from itertools import islice
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

# Finite and bounded, so a mix can never overflow float32 into inf or NaN.
Number = Annotated[float, Field(allow_inf_nan=False, ge=-1e6, le=1e6)]
# Layers or mixes per request: each one is a copy of the answer, so a list of a million would need
# a million times its memory.
MAX_OUTPUTS = 8
# Weights of a mix, one per layer: ELMo's have 3 layers (4 with the token layer counted twice); a list longer than
# any model's layers is refused as it is read (service/api/bodies.py), not after a million numbers were built.
MAX_LAYERS = 64
# Validation stops at a list's first wrong item (pydantic's fail_fast): a body of a million wrong items would
# otherwise cost a million error objects (8 s and 850 MB of the event loop for 2 MB of integers). Likewise at
# most this many unknown fields are reported (each is an error too).
MAX_UNKNOWN_FIELDS = 11
Tokens = Annotated[list[str], Field(fail_fast=True)]
MODEL_DESCRIPTION = "the served model to use (GET /v1/models lists them); default: the first (404 for another name)"
# What OpenAI's API also takes as `input`, and LangChain's OpenAIEmbeddings sends by default (tiktoken's ids): ids
# of OpenAI's tokenizer mean nothing to an ELMo, which reads characters.
TOKEN_IDS = (
    "token ids are not taken here: send the texts as strings (LangChain's OpenAIEmbeddings sends token ids unless "
    "it is made with check_embedding_ctx_length=False)"
)


class _Strict(BaseModel):
    # No silent coercion ("1" is not a number) and no unknown fields (a typo is an error, not ignored).
    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _few_unknown_fields(cls, data):
        fields = cls.model_fields
        if isinstance(data, dict) and len(data) > len(fields) + MAX_UNKNOWN_FIELDS:
            unknown = set(islice((name for name in data if name not in fields), MAX_UNKNOWN_FIELDS))
            return {name: value for name, value in data.items() if name in fields or name in unknown}
        return data


class Mix(_Strict):
    weights: list[Number] | None = Field(
        None, fail_fast=True, max_length=MAX_LAYERS, description="scalar weights s_j, one per layer; default all 0"
    )
    gamma: Number = Field(1.0, description="scale of the mix")
    normalize: Literal["softmax", "none"] = Field("softmax", description="softmax(s) (the paper's mix) or s as is")
    layer_norm: bool = Field(False, description="normalize each layer over the sentence's tokens and dims first")


class EmbedRequest(Mix):
    model: str | None = Field(None, description=MODEL_DESCRIPTION)
    sentences: list[Tokens | str] = Field(
        ...,
        min_length=1,
        fail_fast=True,
        description="pre-tokenized sentences (lists of tokens), or strings that the server tokenizes (Moses)",
        examples=[[["The", "bank", "of", "the", "river", "."], "She went to the bank to deposit money."]],
    )
    output: Literal["mix", "layers"] = Field("mix", description="the scalar mix, or the per-layer vectors")
    layers: list[int] | None = Field(
        None,
        fail_fast=True,
        min_length=1,
        max_length=MAX_OUTPUTS,
        description='with output "layers": which layers, in this order',
    )
    pooling: Literal["none", "mean"] = Field("none", description='"mean" averages over the tokens')
    encoding: Literal["float", "base64"] = Field(
        "float", description="base64: little-endian float32 (float16 with dtype), C order"
    )
    dtype: Literal["float32", "float16"] = Field(
        "float32",
        description="float16: half the bytes, each number rounded once (base64 or the .npz answer only; the error "
        "on the default model is in the docs' GPU page)",
    )
    mixes: list[Mix] | None = Field(
        None, fail_fast=True, min_length=1, max_length=MAX_OUTPUTS, description="several mixes at once: one per entry"
    )
    unit_length: bool = Field(
        False,
        description="scale every vector of the answer (its last axis) to L2 norm 1, after the mix and pooling "
        "(not the mix's `normalize`, which is about the weights)",
    )
    truncate: bool = Field(
        False,
        description="cut a sentence over the server's tokens-per-sentence limit to the limit instead of refusing "
        "the request with 413; the item then says so",
    )
    boundaries: bool = Field(
        False,
        description="add the sentence boundaries' vectors as the biLM computes them (<S> first, </S> last: "
        "n_tokens + 2 positions, which layer_norm and pooling then count; allennlp's keep_sentence_boundaries); an "
        "empty sentence is then its two boundaries",
    )


class EmbeddingItem(BaseModel):
    index: int
    tokens: list[str]
    embedding: list | str = Field(..., description="nested lists of shape `shape`, or one base64 string")
    shape: list[int]
    dtype: Literal["float16"] | None = Field(None, description='with dtype "float16": the base64 bytes are float16')
    truncated: bool | None = Field(None, description="with `truncate`: whether the sentence was cut to the limit")
    original_tokens: int | None = Field(None, description="with `truncate`: the sentence's tokens before the cut")
    original_tokens_at_least: bool | None = Field(
        None,
        description="with `truncate`, true where a text was cut before Moses read it all (only what can be kept is "
        "tokenized): original_tokens is then its words, a lower bound on its tokens",
    )


class Usage(BaseModel):
    sentences: int
    tokens: int


class EmbedResponse(BaseModel):
    model: str
    dim: int
    num_layers: int
    data: list[EmbeddingItem]
    usage: Usage


class TokenizeRequest(_Strict):
    model: str | None = Field(None, description=MODEL_DESCRIPTION)
    sentences: list[Tokens | str] = Field(
        ...,
        min_length=1,
        fail_fast=True,
        description="what /embed takes: pre-tokenized sentences, or strings that the server tokenizes (Moses)",
        examples=[["She went to the bank.", ["a", "pneumonoultramicroscopicsilicovolcanoconiosis-like"]]],
    )
    truncate: bool = Field(False, description="as on /embed: cut a sentence over the limit instead of a 413")


class TokenizedSentence(BaseModel):
    index: int
    tokens: list[str] = Field(..., description="the tokens /embed reads (after any cut), as it echoes them")
    utf8_bytes: list[int] = Field(..., description="each token's UTF-8 bytes")
    kept_bytes: list[int] = Field(..., description="how many of those (the first ones) the model reads: see token_cut")
    truncated: bool = Field(..., description="whether the sentence was cut to max_tokens_per_sentence (truncate)")
    original_tokens: int = Field(..., description="the sentence's tokens before any cut")
    original_tokens_at_least: bool | None = Field(
        None,
        description="with `truncate`, true where a text was cut before Moses read it all (only what can be kept is "
        "tokenized): original_tokens is then its words, a lower bound on its tokens",
    )


class TokenizeResponse(BaseModel):
    model: str
    max_tokens_per_sentence: int
    max_bytes_per_token: int | None = Field(
        ...,
        description="max_characters_per_token - 2 (the begin/end-of-word marks) for a model that reads bytes "
        "(bilm-tf's family); null for one that reads characters (ELMoForManyLangs)",
    )
    token_cut: str = Field(..., description="what of a long token the model reads, e.g. 'the first 48 UTF-8 bytes'")
    data: list[TokenizedSentence]
    usage: Usage


class OpenAIEmbeddingRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # OpenAI clients send fields such as `user`

    input: str | Tokens = Field(..., description="a string or a list of strings")
    model: str | None = Field(None, description=MODEL_DESCRIPTION)
    encoding_format: Literal["float", "base64"] = "float"
    unit_length: bool = Field(False, description="scale each vector to L2 norm 1")
    truncate: bool = Field(False, description="cut an input over the tokens-per-sentence limit instead of a 413")
    # OpenAI's schema has it; ignored, a client would get vectors of a size it did not ask for: only the
    # model's own is accepted (422 otherwise).
    dimensions: int | None = Field(None, description="the model's dim, if given (vectors cannot be shortened)")

    @field_validator("input", mode="before")
    @classmethod
    def _no_token_ids(cls, value):
        if _token_ids(value):
            raise PydanticCustomError("token_ids", TOKEN_IDS)
        return value


def _token_ids(value) -> bool:
    """A list of ints, or of lists of ints: OpenAI's token-id input."""

    def ints(items) -> bool:
        return isinstance(items, list) and bool(items) and all(type(i) is int for i in items)

    return isinstance(value, list) and bool(value) and (ints(value) or all(ints(item) for item in value))


class OpenAIEmbedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str
    truncated: bool | None = Field(None, description="with `truncate`: whether the input was cut to the limit")
    original_tokens: int | None = Field(None, description="with `truncate`: the input's tokens before the cut")
    original_tokens_at_least: bool | None = Field(
        None,
        description="with `truncate`, true where a text was cut before Moses read it all (only what can be kept is "
        "tokenized): original_tokens is then its words, a lower bound on its tokens",
    )


class OpenAIUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class OpenAIEmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIEmbedding]
    model: str
    usage: OpenAIUsage


class ModelObject(BaseModel):
    id: str = Field(..., description="the name requests give as `model`")
    object: Literal["model"] = "model"
    created: int = Field(..., description="when the model's export was written (its manifest's mtime, Unix seconds)")
    owned_by: str = "elmo-service"
    dim: int
    num_layers: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject] = Field(..., description="the models served; the first is the default")


class ErrorResponse(BaseModel):
    detail: str | list
    request_id: str | None = Field(None, description="the answer's X-Request-Id: what its log lines carry")


class OpenAIError(BaseModel):
    message: str = Field(..., description="what /embed's `detail` says of the same mistake")
    type: str = Field(..., description="invalid_request_error, or server_error (503: overloaded, starting, draining)")
    param: str | None = Field(..., description="the field at fault, if one is")
    code: str | None = Field(..., description="model_not_found (404), invalid_api_key (401), else null")


class OpenAIErrorResponse(BaseModel):
    """The /v1/* routes' errors, in OpenAI's shape (400 where the other routes answer 413 or 422)."""

    error: OpenAIError
    request_id: str | None = Field(None, description="the answer's X-Request-Id: what its log lines carry")
