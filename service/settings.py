"""Every setting of the service, from `ELMO_*` environment variables (or elmo-serve flags), in one place."""

from __future__ import annotations

import difflib
import ipaddress
import re
from collections.abc import Mapping
from importlib.resources import files
from pathlib import Path
from typing import Annotated

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from service.engine.canary import MARGIN

# Tokens in flight (and per elmo-embed batch) when ELMO_BATCH_TOKENS / --batch-tokens is not given, by the engine's
# provider: 2 CPU cores are busy with 4096 (README, Measured performance); a GPU wants far more rows at once (an
# H100 went from 12,594 tokens/s at 32 rows to 57,359 at 1024; README, GPU), and the engine has 1024 slots.
PROVIDER_BATCH_TOKENS = {"CPUExecutionProvider": 4096, "CUDAExecutionProvider": 65536}


def default_batch_tokens(provider: str) -> int:
    """The token budget for an engine on `provider` (an ONNX Runtime provider name), when none is set."""
    return PROVIDER_BATCH_TOKENS.get(provider, PROVIDER_BATCH_TOKENS["CPUExecutionProvider"])


# Positions each sentence in flight advances per engine call (the Loop graph's), when ELMO_WINDOW is not given, by
# what the CPU has: on an AMX host the engine is fast enough that each call's fixed costs tell, and 16 served 32
# clients 7% (fp32) to 10% (int8) more tokens/s than 8, with lower latencies (docs/performance.md, "A window for
# the host"); on an AVX-512 VNNI host 16 was no better (same page), so elsewhere it stays 8.
DEFAULT_WINDOW, AMX_WINDOW = 8, 16


def default_window(cpu_flags: frozenset[str]) -> int:
    """The window for the Loop graph on a CPU with these flags (/proc/cpuinfo's names), when none is set."""
    return AMX_WINDOW if "amx_int8" in cpu_flags else DEFAULT_WINDOW


def embedded_model_dir() -> Path:
    """The embedded default model's export (models/default/ through elmo-export), shipped inside this package as
    data (service/embedded/default/, written by `make default-export`): what elmo-serve serves, and elmo-embed
    embeds with, when no model is named. Found through importlib.resources, so an installed wheel finds its own."""
    return Path(str(files("service") / "embedded" / "default"))


DEFAULT_MODEL_DIR = embedded_model_dir()
# A model's name in ELMO_MODELS: what requests name it by, in URLs, metric labels and logs.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def parse_models(text: str) -> list[tuple[str, Path]]:
    """`name=folder,name2=folder2` (ELMO_MODELS, elmo-serve --models) as (name, folder) pairs, in order."""
    pairs = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, equals, folder = item.partition("=")
        if not equals or not name.strip() or not folder.strip():
            raise ValueError(f"{item!r} is not name=folder (ELMO_MODELS=name=folder,name2=folder2)")
        pairs.append((name.strip(), Path(folder.strip())))
    return pairs


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ELMO_", extra="ignore")

    model_dir: Path = Field(
        DEFAULT_MODEL_DIR, description="folder written by elmo-export; default: the embedded default model's export"
    )
    model_name: str | None = Field(None, description="name reported in responses; default: the folder name")
    # Several models: ELMO_MODELS=name=folder,name2=folder2 (the first is the default). Unset: one model, model_dir,
    # named model_name or its folder's name; once validated, the models in force either way.
    models: Annotated[list[tuple[str, Path]], NoDecode] = Field(
        [],
        description="name=folder pairs, comma-separated, each served with its own engine and queue; the first is "
        "the default; unset: model_dir alone",
    )
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)

    # batching
    batch_tokens: int | None = Field(
        None,
        ge=1,
        description="tokens of the sentences in flight together, boundaries included; "
        "unset: 4096 on the CPU, 65536 on CUDA (/info shows the value in force)",
    )
    max_wait_ms: float = Field(2.0, ge=0, description="how long an idle engine waits for more sentences to start with")
    window: int | None = Field(
        None,
        ge=1,
        description="positions each sentence in flight advances per engine call; new ones join between calls; "
        "unset: 16 on a CPU with AMX, 8 otherwise (/info shows the value in force)",
    )
    gather_ms: float = Field(
        10.0, ge=0, description="after a window that answered clients, how long to wait for them to send again"
    )
    queue_tokens: int = Field(65536, ge=1, description="tokens waiting at most; more is answered 503")

    # request limits (413 above them)
    max_sentences: int = Field(512, ge=1, description="sentences per request")
    max_tokens_per_sentence: int = Field(1000, ge=1, description="tokens per sentence")
    max_body_bytes: int = Field(8 << 20, ge=1, description="request body size")
    max_inflight_bytes: int = Field(
        64 << 20, ge=1, description="bodies of all requests in flight together (503 above); at least max_body_bytes"
    )
    # One client (an address) could otherwise hold the whole budget with a few stalled uploads.
    max_inflight_bytes_per_client: int = Field(
        16 << 20,
        ge=1,
        description="bodies in flight from one client address (503 above); at least max_body_bytes",
    )
    max_text_chars: int = Field(
        1_000_000, ge=1, description="characters of a sentence sent as text, for the server to tokenize"
    )
    # 64 MiB of JSON takes orjson about 0.3 s and the client longer: a bound on one answer's memory and time.
    max_answer_bytes: int = Field(
        64 << 20, ge=1, description="an answer's size, estimated before the engine runs (17 bytes a JSON number)"
    )
    # Answers wait for their clients to read them: without a bound, 40 clients that never read held 1.6 GB.
    max_answers_inflight_bytes: int = Field(
        128 << 20,
        ge=1,
        description="the estimated sizes of all answers being made or sent together (503 above); at least "
        "max_answer_bytes",
    )
    # One address's flood of large answers could otherwise hold the whole budget: others' small requests got 503.
    max_answers_inflight_bytes_per_client: int = Field(
        64 << 20,
        ge=1,
        description="the estimated sizes of the answers being made or sent to one client address (503 above); at "
        "least max_answer_bytes",
    )

    # connections: how long a client may take, and how large a request head may be (a slow or idle one would
    # otherwise hold a connection, and its body the in-flight budget, for as long as it likes)
    head_timeout_s: float = Field(
        10.0, gt=0, description="a request line and headers must arrive within this of the connection or first byte"
    )
    body_timeout_s: float = Field(10.0, gt=0, description="longest wait for the next part of a body (408 after it)")
    # Holding the in-flight budget costs what the bodies are sent at: at 64 KiB/s, about 4 Mbit/s held all of it.
    body_min_rate: int = Field(
        512 << 10, ge=0, description="bytes/s a body must average once body_timeout_s has passed (0: no minimum)"
    )
    write_timeout_s: float = Field(
        30.0, gt=0, description="a connection whose answer is not being read is closed after this (its memory freed)"
    )
    max_pipelined: int = Field(
        16, ge=1, description="requests waiting on one connection behind the one answered; nothing more is read"
    )
    answer_half_closed: bool = Field(
        False,
        description="answer a client that closes its sending side after its request (default: it is taken as gone "
        "and its request cancelled; TCP cannot tell the two apart)",
    )
    keep_alive_s: float = Field(5.0, gt=0, description="an idle connection between requests is closed after this")
    max_header_bytes: int = Field(16384, ge=1024, description="request line and headers together (431 above)")
    max_headers: int = Field(100, ge=8, description="headers per request (431 above)")
    # Connections hold descriptors: past the open-files limit accept() fails and other clients are reset.
    max_connections: int = Field(
        0,
        ge=0,
        description="connections held at most (503 and closed above); 0: the open-files limit (raised to its hard "
        "limit at start) less a reserve of a tenth, at least 64",
    )
    max_connections_per_client: int = Field(
        512, ge=1, description="connections from one client address (503 and closed above); trusted proxies excepted"
    )

    # ONNX Runtime
    provider: str = Field("auto", pattern="^(auto|cpu|cuda)$")
    intra_op_threads: int = Field(0, ge=0, description="0: one per core")
    inter_op_threads: int = Field(0, ge=0)
    token_cache: int = Field(50_000, ge=0, description="token vectors kept for frequent words (0: none)")
    precision: str = Field(
        "fp32",
        pattern="^(fp32|fp16|int8)$",
        description="fp32: exact (1e-5); int8: the CPU's int8 Loop graph; fp16: the reduced-precision window graph "
        "(both opt-in, within the error their export states)",
    )
    canary: str = Field(
        "refuse",
        pattern="^(refuse|warn)$",
        description="at start-up each engine embeds its export's canary sentences and compares them with the "
        "reference: refuse to start when they disagree beyond the graph's allowance, or warn and serve",
    )
    canary_margin: float = Field(
        MARGIN, ge=0, description="how far beyond its stated error a reduced precision's canaries may go (0.5: 50%)"
    )
    device_id: int = Field(0, ge=0, description="the GPU to run on (CUDA device order)")
    cuda_graphs: bool = Field(False, description="capture each batch shape as a CUDA graph (CUDA only)")
    max_rows: int = Field(1024, ge=1, description="sentences in flight at most (slots of the engine's state store)")

    # CPU pools of their own, so that neither waits for the other nor for the default pool (six abandoned texts
    # once held every worker for 80 s)
    tokenize_threads: int = Field(2, ge=1, description="threads tokenizing texts (Moses), in turns by client address")
    max_tokenize_chars_per_client: int | None = Field(
        None,
        ge=1,
        description="characters of texts waiting or being tokenized for one client address (503 above; a single "
        "request is always taken); unset: ELMO_MAX_BODY_BYTES",
    )
    encode_threads: int = Field(2, ge=1, description="threads composing and encoding large answers")

    retry_after_s: int = Field(1, ge=1, description="Retry-After of a 503")
    drain_s: float = Field(30.0, ge=0, description="on SIGTERM, how long requests in flight may take to finish")

    # access (comma-separated lists in the environment: ELMO_API_KEYS=key1,key2)
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        [], description="when set, every route but /health/* needs `Authorization: Bearer <one of them>`"
    )
    cors_origins: Annotated[list[str], NoDecode] = Field([], description="origins allowed by CORS; none: no CORS")
    # A loopback-bound server answers loopback Host names alone: a web page that makes its name resolve to
    # 127.0.0.1 (DNS rebinding) could call it otherwise (service/server/hosts.py).
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        [],
        description="Host names answered besides localhost, 127.0.0.1 and [::1] when ELMO_HOST is a loopback "
        "address (a leading dot: the name and its subdomains; *: any); another ELMO_HOST answers any name",
    )
    explore: bool = Field(True, description="serve the /explore page (its files need no API key; its calls do)")
    # Trusted from 127.0.0.1 by uvicorn's default, X-Forwarded-For let any local process choose its address.
    forwarded_allow_ips: Annotated[list[str], NoDecode] = Field(
        [],
        description="addresses or networks of the reverse proxies whose X-Forwarded-For and X-Forwarded-Proto are "
        "trusted; none: the connection's address is the client's",
    )

    log_level: str = Field("info", pattern="^(critical|error|warning|info|debug)$")
    log_request_text: bool = Field(False, description="log each request's sentences (off: no request text in logs)")
    log_format: str = Field(
        "text",
        pattern="^(text|json)$",
        description="text, or json: one JSON object a line (time, level, logger, message, and the request's id, "
        "route, model and counts), uvicorn's lines too",
    )
    access_log: bool = Field(
        False, description="a line per request: method, route, status, duration, client, model, tokens, request id"
    )
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="also serve /metrics on this port of ELMO_HOST, without API keys (for Prometheus); unset: "
        "/metrics on the main port alone, behind the keys if any",
    )

    @field_validator("api_keys", "cors_origins", "forwarded_allow_ips", "allowed_hosts", mode="before")
    @classmethod
    def _comma_separated(cls, value):
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _addresses_or_networks(cls, value: list[str]) -> list[str]:
        for entry in value:
            if entry == "*":
                raise ValueError("'*' would trust any peer's X-Forwarded-For: name the proxies' addresses or networks")
            try:
                network = ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(f"{entry!r} is neither an IP address nor a network (such as 10.0.0.0/8)") from None
            if network.prefixlen == 0:  # 0.0.0.0/0 and ::/0 are '*' by another name
                raise ValueError(
                    f"{entry!r} is every address, as '*' would be: it would trust any peer's X-Forwarded-For; name "
                    "the proxies' addresses or networks"
                )
        return value

    @field_validator("api_keys", mode="before")
    @classmethod
    def _keys_given_are_keys(cls, value):
        # ",,," would otherwise be no key at all: an open server where one with keys was meant
        if isinstance(value, str) and value.strip() and not any(item.strip() for item in value.split(",")):
            raise ValueError("holds no key, only commas or spaces: give keys (key1,key2), or leave it unset for none")
        return value

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _any_case(cls, value):
        return value.lower() if isinstance(value, str) else value  # DEBUG as debug: logging's and uvicorn's names

    @field_validator("model_dir", mode="before")
    @classmethod
    def _empty_is_unset(cls, value):
        # An image sets ELMO_MODEL_DIR to the model baked in: `-e ELMO_MODEL_DIR=` unsets it beside ELMO_MODELS.
        return DEFAULT_MODEL_DIR if value == "" else value

    @field_validator("models", mode="before")
    @classmethod
    def _name_folder_pairs(cls, value):
        return parse_models(value) if isinstance(value, str) else value

    @field_validator("models")
    @classmethod
    def _names_unique_and_plain(cls, value: list[tuple[str, Path]]) -> list[tuple[str, Path]]:
        names = [name for name, _ in value]
        for name in names:
            if not MODEL_NAME.fullmatch(name):
                raise ValueError(
                    f"model name {name[:80]!r}: letters, digits, '.', '_' and '-', starting with a letter or digit, "
                    "at most 64 characters"
                )
        if twice := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(f"model names must be unique: {', '.join(twice)} given more than once")
        return value

    @model_validator(mode="after")
    def _one_model_or_several(self) -> Settings:
        if not self.models:
            self.models = [(self.model_name or self.model_dir.name, self.model_dir)]
            return self
        if self.model_dir != DEFAULT_MODEL_DIR:
            raise ValueError(
                f"both ELMO_MODELS and ELMO_MODEL_DIR (or --model: {self.model_dir}) given: name every model in "
                "ELMO_MODELS (name=folder,name2=folder2) and leave ELMO_MODEL_DIR unset"
            )
        if self.model_name is not None:
            raise ValueError(
                "both ELMO_MODELS and ELMO_MODEL_NAME given: ELMO_MODELS names its models (name=folder); "
                "leave ELMO_MODEL_NAME unset"
            )
        return self

    @model_validator(mode="after")
    def _metrics_port_apart(self) -> Settings:
        if self.metrics_port is not None and self.metrics_port != 0 and self.metrics_port == self.port:
            raise ValueError(
                f"ELMO_METRICS_PORT ({self.metrics_port}) is ELMO_PORT: the metrics need a port of their own (or "
                "leave ELMO_METRICS_PORT unset: /metrics is then on the main port)"
            )
        return self

    @model_validator(mode="after")
    def _a_largest_body_fits(self) -> Settings:
        for name in ("max_inflight_bytes", "max_inflight_bytes_per_client"):
            if getattr(self, name) < self.max_body_bytes:
                raise ValueError(
                    f"{variable(name)} ({getattr(self, name)}) is below ELMO_MAX_BODY_BYTES ({self.max_body_bytes}): "
                    "a body at the limit could never be taken; raise one or lower the other"
                )
        for name in ("max_answers_inflight_bytes", "max_answers_inflight_bytes_per_client"):
            if getattr(self, name) < self.max_answer_bytes:
                given, limit = getattr(self, name), self.max_answer_bytes
                raise ValueError(
                    f"{variable(name)} ({given}) is below ELMO_MAX_ANSWER_BYTES ({limit}): an answer at the limit "
                    "could never be made; raise one or lower the other"
                )
        return self

    def public(self, **resolved) -> dict:
        """The values in force, as /info shows them (API keys as asterisks); `resolved`: the values of settings
        left unset, as the engine's provider decided them."""
        values = self.model_dump(mode="json")
        values.update({name: value for name, value in resolved.items() if values.get(name) is None})
        # the default model's, also where ELMO_MODELS named the models (and model_dir kept its unused default);
        # folders by their names only: where the server's files lie is no client's business
        values["model_name"], values["model_dir"] = self.models[0][0], self.models[0][1].name
        values["models"] = [[name, folder.name] for name, folder in self.models]
        return values


# What elmo_client reads (the allennlp adapter's service and key): set in shells that also run the server.
CLIENT_VARIABLES = frozenset({"ELMO_URL", "ELMO_API_KEY"})


def variable(name: str) -> str:
    """The environment variable of a setting."""
    return f"ELMO_{name.upper()}"


def invalid_settings(err: ValidationError) -> list[str]:
    """One line per problem of the settings, instead of pydantic's report: the variable, the value given and what
    it takes (`ELMO_PORT='abc' is not valid: it takes an integer from 0 to 65535`), or for settings that conflict,
    why."""
    lines = []
    for problem in err.errors():
        reason = problem.get("ctx", {}).get("error")  # a ValueError of a validator above: its own message
        if not problem["loc"]:  # settings that conflict (a model validator): its message names them
            lines.append(str(reason or problem["msg"]))
            continue
        name = str(problem["loc"][0])
        given = f"{variable(name)}={problem['input']!r}" if isinstance(problem["input"], str) else variable(name)
        lines.append(f"{given}: {reason}" if reason else f"{given} is not valid: it takes {allowed(name)}")
    return lines


def allowed(name: str) -> str:
    """What a setting takes, in words, from its type and constraints."""
    field = Settings.model_fields[name]
    types = getattr(field.annotation, "__args__", (field.annotation,))  # int | None: (int, NoneType)
    words = ((bool, "true or false"), (int, "an integer"), (float, "a number"), (Path, "a folder"))
    kind = next((said for t, said in words if t in types), "a string")
    bound = {b: getattr(m, b) for m in field.metadata for b in ("ge", "gt", "le") if hasattr(m, b)}
    if "ge" in bound and "le" in bound:
        kind += f" from {bound['ge']} to {bound['le']}"
    elif "ge" in bound:
        kind += f" of at least {bound['ge']}"
    elif "gt" in bound:
        kind += f" above {bound['gt']}"
    pattern = next((m.pattern for m in field.metadata if getattr(m, "pattern", None)), None)
    if pattern and (choices := re.fullmatch(r"\^\(([\w|]+)\)\$", pattern)):
        kind = "one of " + ", ".join(choices[1].split("|"))
    if field.default is None:
        kind += ", or unset"
    return kind


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A warning for each ELMO_* variable that is no setting (a misspelled one would be ignored in silence), with
    the setting whose name is closest."""
    known = {variable(name) for name in Settings.model_fields}
    lines = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith("ELMO_") or upper in known or upper in CLIENT_VARIABLES:
            continue
        # compared without the prefix that they all share: ELMO_FOO is not close to ELMO_PORT
        close = difflib.get_close_matches(upper[5:], [k[5:] for k in known], n=1, cutoff=0.7)
        hint = f"did you mean ELMO_{close[0]}?" if close else "the settings are listed in README.md, Configuration"
        lines.append(f"{name} is not a setting and is ignored: {hint}")
    return lines
