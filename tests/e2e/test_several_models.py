"""Several models in one server (ELMO_MODELS, service/models.py), end to end: a real elmo-serve on 127.0.0.1 serving
the embedded default model (3 layers of 256), the tiny fixture (3 layers of 32) and an ELMoForManyLangs model (the
other family: its own char and word dictionaries, German tokenization; 3 layers of 16), each with its own engine and
queue. Every answer is checked against an Engine in this process on the same folder: a request gets the numbers of
the model it named, no `model` means the first, concurrent requests to both get their own; an unknown name is 404
naming those served; /v1/models, /info, /metrics and readiness cover each; a flooded model answers 503 while the
other still answers 200; a model that cannot load stops the start naming it; the client passes `model` through and
plans its requests by that model's limits."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess

import httpx
import numpy as np
import pytest
from elmo_client import AsyncClient, Client, ElmoError

from service.engine.session import Engine
from service.text.moses import tokenize
from tests.conftest import MANYLANGS, max_error
from tests.live_server import counter, free_port, launch, running_server

NAMES = ("default", "tiny", "manylangs")  # in ELMO_MODELS' order: "default" is the first, so the default
SHAPES = {"default": (3, 256), "tiny": (3, 32), "manylangs": (3, 16)}  # (num_layers, dim)
ANSWER_BYTES = 4 << 20  # small enough that the client must split the 256-dim model's answers, not the 32-dim's
TOLERANCE = 1e-5
SERVED = "this server serves: default, tiny, manylangs"


def models_setting(folders: dict) -> str:
    return ",".join(f"{name}={folder}" for name, folder in folders.items())


@pytest.fixture(scope="module")
def folders(default_model_dir, tiny_model_dir, manylangs_model_dir) -> dict:
    return {"default": default_model_dir, "tiny": tiny_model_dir, "manylangs": manylangs_model_dir}


@pytest.fixture(scope="module")
def server(folders, tmp_path_factory):
    settings = {"ELMO_MODELS": models_setting(folders), "ELMO_MAX_ANSWER_BYTES": str(ANSWER_BYTES)}
    with running_server(None, tmp_path_factory.mktemp("served"), settings) as s:  # no --model: ELMO_MODELS
        yield s


@pytest.fixture(scope="module")
def engines(folders) -> dict[str, Engine]:
    return {name: Engine(folder, provider="cpu", intra_op_threads=1) for name, folder in folders.items()}


def post(client: httpx.Client, path: str, body: dict) -> dict:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def layers(item: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(item["embedding"]), "<f4").reshape(item["shape"])


def own(sentences, n: int, tag: str) -> list[list[str]]:
    """n sentences of the fixture, each made unique by a last token of its own."""
    return [[*sentences[k % len(sentences)][:30], f"{tag}-{k}"] for k in range(n)]


# -- start and readiness --------------------------------------------------------------------------------------------


def test_ready_once_every_model_is_loaded_and_warm(server, client, engines):
    assert client.get("/health/ready").json() == {"status": "ready"}
    for name in NAMES:  # each model's warm-up batch ran
        assert counter(client, "elmo_batch_sentences_count", model=name) >= 1
        assert SHAPES[name] == (engines[name].num_layers, engines[name].dim)
    log = server.log.read_text()
    ready = log.index("Application startup complete")  # the lifespan ends after every model is warm
    assert log.index("serving default from") < log.index("serving tiny from") < ready


def test_a_model_that_cannot_load_stops_the_start_naming_it(folders, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(folders["tiny"], broken)
    (broken / "model.onnx").write_bytes((broken / "model.onnx").read_bytes()[:100_000])
    cases = {  # the second model's folder -> what the message says
        broken: f"cannot load the model 'second' from {broken}: InvalidProtobuf",
        tmp_path / "missing": f"model 'second': {tmp_path / 'missing' / 'manifest.json'} not found",
    }
    for folder, message in cases.items():
        log = tmp_path / f"{folder.name}.log"
        proc = launch(None, log, {"ELMO_MODELS": f"first={folders['default']},second={folder}"}, free_port())
        try:
            returncode = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail(f"still running 60 s after start:\n{log.read_text()}")
        text = log.read_text()
        assert returncode != 0 and message in text, text
        assert "Uvicorn running" not in text


def test_elmo_models_with_a_model_folder_is_refused_naming_both(folders, tmp_path):
    log = tmp_path / "server.log"
    proc = launch(folders["tiny"], log, {"ELMO_MODELS": models_setting(folders)}, free_port())  # and --model
    assert proc.wait(timeout=60) == 1
    assert "both ELMO_MODELS and ELMO_MODEL_DIR" in log.read_text()


# -- each request answered by the model it named --------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_each_model_answers_with_its_own_numbers(client, engines, sentences, expected, name):
    batch = sentences[:10]
    body = post(client, "/embed", {"model": name, "sentences": batch, "output": "layers", "encoding": "base64"})
    num_layers, dim = SHAPES[name]
    assert (body["model"], body["dim"], body["num_layers"]) == (name, dim, num_layers)
    got = [layers(item) for item in body["data"]]
    assert [g.shape for g in got] == [(num_layers, len(s), dim) for s in batch]
    assert max_error(got, engines[name].run(batch)) <= TOLERANCE
    if name == "tiny":  # and allennlp's own layers of the fixture
        assert max_error(got, expected[:10]) <= TOLERANCE
    if name == "manylangs":  # and the elmoformanylangs package's own layers of its fixture
        fixture = json.loads((MANYLANGS / "sentences.json").read_text(encoding="utf-8"))
        body = post(client, "/embed", {"model": name, "sentences": fixture, "output": "layers", "encoding": "base64"})
        package = np.load(MANYLANGS / "expected_layers.npz")
        assert max_error([layers(item) for item in body["data"]], [package[f"s{i}"] for i in range(5)]) <= TOLERANCE


def test_no_model_means_the_first(client, sentences):
    batch = {"sentences": sentences[:3], "output": "layers", "encoding": "base64"}
    unnamed, named = post(client, "/embed", batch), post(client, "/embed", {**batch, "model": "default"})
    assert (unnamed["model"], unnamed["dim"]) == ("default", 256)
    for a, b in zip(unnamed["data"], named["data"], strict=True):
        np.testing.assert_array_equal(layers(a), layers(b))
    openai = post(client, "/v1/embeddings", {"input": "The bank of the river."})
    assert openai["model"] == "default" and len(openai["data"][0]["embedding"]) == 256
    assert post(client, "/tokenize", {"sentences": ["a b"]})["model"] == "default"


@pytest.mark.parametrize("name", NAMES)
def test_openai_embeddings_come_from_the_model_named(client, engines, name):
    texts = ["The bank of the river.", "Hello, world!"]
    body = post(client, "/v1/embeddings", {"input": texts, "model": name})
    assert body["model"] == name
    got = [np.asarray(item["embedding"], np.float32) for item in body["data"]]
    # the mean over tokens of the average of the layers
    tokens = [tokenize(t, engines[name].info.language) for t in texts]
    want = [h.astype(np.float64).mean(axis=(0, 1)) for h in engines[name].run(tokens)]
    assert [g.shape for g in got] == [(SHAPES[name][1],)] * 2
    assert max_error(got, want) <= TOLERANCE


@pytest.mark.parametrize("name", NAMES)
def test_tokenize_reads_with_the_model_named(client, engines, name):
    body = post(client, "/tokenize", {"model": name, "sentences": ["Don't panic!", ["a", "é" * 30], "ca. 5 Uhr"]})
    assert body["model"] == name
    assert body["data"][1]["utf8_bytes"] == [1, 60]
    if name == "manylangs":  # reads characters (48 of them), and text by German rules
        assert (body["max_bytes_per_token"], body["token_cut"]) == (None, "the first 48 characters")
        assert body["data"][1]["kept_bytes"] == [1, 60] and body["data"][2]["tokens"] == ["ca.", "5", "Uhr"]
    else:  # reads bytes (48 of them), and text by English rules
        assert body["max_bytes_per_token"] == engines[name].info.max_chars - 2 == 48
        assert body["data"][1]["kept_bytes"] == [1, 48] and body["data"][2]["tokens"] == ["ca", ".", "5", "Uhr"]


async def _post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=100)) as http:
        return await asyncio.gather(*(http.post("/embed", json=body) for body in bodies))


def test_concurrent_requests_to_both_models_each_get_their_own(server, engines, sentences):
    requests = [(NAMES[k % 3], own(sentences, 1 + k % 4, f"r{k}")[k % 4 :]) for k in range(60)]
    bodies = [{"model": name, "sentences": sent, "output": "layers", "encoding": "base64"} for name, sent in requests]
    answers = asyncio.run(_post_all(server.url, bodies))
    for name in NAMES:
        mine = [(sent, answer) for (n, sent), answer in zip(requests, answers, strict=True) if n == name]
        want = engines[name].run([s for sent, _ in mine for s in sent])
        got = []
        for sent, answer in mine:
            assert answer.status_code == 200, answer.text
            body = answer.json()
            assert (body["model"], body["dim"]) == (name, SHAPES[name][1])
            assert [item["tokens"] for item in body["data"]] == sent  # its own sentences, in its order
            got += [layers(item) for item in body["data"]]
        assert max_error(got, want) <= TOLERANCE


# -- unknown names --------------------------------------------------------------------------------------------------

UNKNOWN = [  # (method, path, JSON body, query)
    ("POST", "/embed", {"model": "nope", "sentences": [["a"]]}, None),
    ("POST", "/tokenize", {"model": "nope", "sentences": [["a"]]}, None),
    ("POST", "/v1/embeddings", {"model": "nope", "input": "a"}, None),
    ("GET", "/info", None, {"model": "nope"}),
    ("GET", "/v1/models/nope", None, None),
]


@pytest.mark.parametrize(("method", "path", "body", "query"), UNKNOWN, ids=[u[1] for u in UNKNOWN])
def test_an_unknown_model_is_404_naming_those_served(client, method, path, body, query):
    response = client.request(method, path, json=body, params=query)
    assert response.status_code == 404, response.text
    message = f"model: unknown model 'nope'; {SERVED}"
    request_id = response.headers["x-request-id"]
    if path.startswith("/v1/"):  # OpenAI's shape, and its code
        error = {"message": message, "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
        assert response.json() == {"error": error, "request_id": request_id}
    else:
        assert response.json() == {"detail": message, "request_id": request_id}


def test_names_are_exact_and_a_long_one_is_not_echoed_whole(client):
    for name in ("Tiny", "tiny ", ""):
        response = client.post("/embed", json={"model": name, "sentences": [["a"]]})
        assert response.status_code == 404 and response.json()["detail"].endswith(SERVED), name
    response = client.post("/embed", json={"model": "x" * 100_000, "sentences": [["a"]]})
    assert response.status_code == 404 and len(response.text) < 300
    assert response.json()["detail"] == f"model: unknown model '{'x' * 64}...'; {SERVED}"


# -- /v1/models, /info, /metrics ------------------------------------------------------------------------------------


def test_v1_models_lists_each_model_the_default_first(client, folders):
    body = client.get("/v1/models").json()
    assert body == {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": int((folders[name] / "manifest.json").stat().st_mtime),
                "owned_by": "elmo-service",
                "dim": SHAPES[name][1],
                "num_layers": SHAPES[name][0],
            }
            for name in NAMES
        ],
    }
    for item in body["data"]:
        assert client.get(f"/v1/models/{item['id']}").json() == item


def test_info_keeps_the_default_on_top_and_describes_every_model(client, folders):
    info = client.get("/info").json()
    assert (info["model"], info["dim"], info["num_layers"]) == ("default", 256, 3)  # what older clients read
    assert info["limits"]["queue_tokens"] == 65536 and info["limits"]["batch_tokens"] == 4096
    assert info["limits"]["max_answer_bytes"] == ANSWER_BYTES
    assert info["settings"]["models"] == [[name, folder.name] for name, folder in folders.items()]
    assert (info["settings"]["model_name"], info["settings"]["model_dir"]) == ("default", folders["default"].name)
    assert list(info["models"]) == list(NAMES)
    for name, model in info["models"].items():
        assert (model["num_layers"], model["dim"]) == SHAPES[name]
        assert model["manifest"]["output_dim"] == SHAPES[name][1] and model["model_dir"] == folders[name].name
        assert (model["provider"], model["precision"], model["graph"]["kind"]) == (
            "CPUExecutionProvider",
            "fp32",
            "loop",
        )
        assert (model["queue_tokens"], model["batch_tokens"]) == (65536, 4096)  # each model's queue and budget
        assert model["created"] == int((folders[name] / "manifest.json").stat().st_mtime)
    assert info["manifest"] == info["models"]["default"]["manifest"]
    tiny = client.get("/info", params={"model": "tiny"}).json()
    assert (tiny["model"], tiny["dim"], tiny["num_layers"]) == ("tiny", 32, 3)
    assert tiny["manifest"] == info["models"]["tiny"]["manifest"]
    assert (tiny["models"], tiny["limits"], tiny["settings"]) == (info["models"], info["limits"], info["settings"])


def test_metrics_count_each_model_on_its_own(client, sentences):
    def joined(name: str) -> float:  # sentences that joined the model's engine: one queue_seconds sample each
        return counter(client, "elmo_queue_seconds_count", model=name)

    before = {name: joined(name) for name in NAMES}
    calls = {name: counter(client, "elmo_inference_seconds_count", model=name) for name in NAMES}
    post(client, "/embed", {"model": "tiny", "sentences": own(sentences, 3, "metrics-tiny")})
    assert (joined("tiny"), joined("default")) == (before["tiny"] + 3, before["default"])
    assert counter(client, "elmo_inference_seconds_count", model="tiny") > calls["tiny"]
    assert counter(client, "elmo_inference_seconds_count", model="default") == calls["default"]
    post(client, "/embed", {"sentences": own(sentences, 2, "metrics-default")})  # the default
    assert (joined("tiny"), joined("default")) == (before["tiny"] + 3, before["default"] + 2)
    text = client.get("/metrics").text
    for name in NAMES:
        assert f'elmo_queue_tokens{{model="{name}"}} 0.0' in text
        assert f'elmo_rejected_total{{model="{name}"}} 0.0' in text
        assert counter(client, "elmo_batch_tokens_count", model=name) > 0


# -- backpressure per model -----------------------------------------------------------------------------------------

CROWDED = {"ELMO_QUEUE_TOKENS": "400", "ELMO_BATCH_TOKENS": "64"}  # both models: small queues, small windows
FLOOD_CLIENTS, FLOOD_ROUNDS = 40, 2


async def _flood_and_trickle(url: str, flood: list[list[dict]], trickle: list[dict]):
    """Flood clients each send their requests to the default model one after the other; meanwhile one client sends
    the tiny model's requests, one after the other, for as long as the flood lasts (all of them at least)."""
    limits = httpx.Limits(max_connections=FLOOD_CLIENTS + 2)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        done = asyncio.Event()

        async def flooder(bodies):
            return [await http.post("/embed", json=body) for body in bodies]

        async def trickler():
            answers, k = [], 0
            while not done.is_set() or k < len(trickle):
                answers.append((k % len(trickle), await http.post("/embed", json=trickle[k % len(trickle)])))
                k += 1
            return answers

        async def flooding():
            try:
                return await asyncio.gather(*(flooder(bodies) for bodies in flood))
            finally:
                done.set()

        return await asyncio.gather(flooding(), trickler())


def test_a_flooded_model_answers_503_while_the_other_still_answers(folders, engines, sentences, tmp_path):
    flood = [  # each request: 3 sentences of the default model, about 100 tokens of the 400 its queue holds
        [
            {"sentences": own(sentences, 3, f"flood-{c}-{r}"), "output": "layers", "encoding": "base64"}
            for r in range(FLOOD_ROUNDS)
        ]
        for c in range(FLOOD_CLIENTS)
    ]
    trickle = [
        {"model": "tiny", "sentences": own(sentences, 2, f"trickle-{k}"), "output": "layers", "encoding": "base64"}
        for k in range(5)
    ]
    settings = {"ELMO_MODELS": models_setting(folders), **CROWDED}
    with running_server(None, tmp_path, settings) as server, httpx.Client(base_url=server.url) as client:
        flooded, trickled = asyncio.run(_flood_and_trickle(server.url, flood, trickle))
        rejected = {name: counter(client, "elmo_rejected_total", model=name) for name in NAMES}
        assert counter(client, "elmo_queue_tokens", model="default") == 0  # nothing left behind

    statuses = [response.status_code for answers in flooded for response in answers]
    assert set(statuses) == {200, 503} and statuses.count(503) >= FLOOD_CLIENTS // 4, statuses
    served = []
    for bodies, answers in zip(flood, flooded, strict=True):
        for body, response in zip(bodies, answers, strict=True):
            if response.status_code == 503:
                assert response.headers["retry-after"] == "1"
                assert response.json()["detail"].startswith("overloaded: model default's queue holds ")
            else:
                assert response.json()["model"] == "default"
                data = response.json()["data"]
                assert [item["tokens"] for item in data] == body["sentences"]
                served += zip(body["sentences"], (layers(item) for item in data), strict=True)
    want = engines["default"].run([sentence for sentence, _ in served[:30]])
    assert max_error([got for _, got in served[:30]], want) <= TOLERANCE

    assert len(trickled) >= len(trickle)
    assert {response.status_code for _, response in trickled} == {200}  # never refused for the other's queue
    want = {k: engines["tiny"].run(body["sentences"]) for k, body in enumerate(trickle)}
    for k, response in trickled:
        assert response.json()["model"] == "tiny"
        assert max_error([layers(item) for item in response.json()["data"]], want[k]) <= TOLERANCE
    assert rejected == {"default": statuses.count(503), "tiny": 0, "manylangs": 0}
    print(
        f"default flooded: {statuses.count(200)} x 200, {statuses.count(503)} x 503; "
        f"tiny meanwhile: {len(trickled)} x 200"
    )


# -- the client -----------------------------------------------------------------------------------------------------


def test_the_client_passes_model_through_and_plans_by_that_models_limits(server, client, engines, sentences):
    big = own(sentences, 120, "client")  # about 3000 tokens: as layers, 1.6 MB of base64 for tiny, 12 MB for default
    with Client(server.url) as elmo:
        assert [m["id"] for m in elmo.models()] == list(NAMES)
        assert (elmo.dim, elmo.num_layers) == (256, 3)  # the default's
        sent = {}
        refused = counter(client, "elmo_requests_total", route="/embed", status="413")
        for name in NAMES:
            before = counter(client, "elmo_requests_total", route="/embed", status="200")
            got = elmo.embed(big, output="layers", model=name)
            sent[name] = counter(client, "elmo_requests_total", route="/embed", status="200") - before
            assert [g.shape for g in got] == [(3, len(s), SHAPES[name][1]) for s in big]
            assert max_error(got, engines[name].run(big)) <= TOLERANCE
        # Under the 4 MiB answer limit: tiny's answer fits one request, default's needs several; planned, not refused.
        assert sent["tiny"] == 1 and sent["default"] >= 3, sent
        assert counter(client, "elmo_requests_total", route="/embed", status="413") == refused
        (item,) = elmo.tokenize([["a", "b"]], model="tiny")
        assert item["tokens"] == ["a", "b"]
        pooled = elmo.embed(big[:2], pooling="mean")  # no model: the default
        assert [p.shape for p in pooled] == [(256,)] * 2


def test_the_async_client_passes_model_through(server, engines, sentences):
    async def run():
        async with AsyncClient(server.url) as elmo:
            return await elmo.models(), await elmo.embed(sentences[:4], output="layers", model="tiny")

    models, got = asyncio.run(run())
    assert [(m["id"], m["dim"]) for m in models] == [("default", 256), ("tiny", 32), ("manylangs", 16)]
    assert max_error(got, engines["tiny"].run(sentences[:4])) <= TOLERANCE


def test_the_allennlp_adapter_embeds_with_the_model_named(server, engines, sentences):
    from elmo_client.allennlp import ElmoEmbedder

    elmo = ElmoEmbedder(url=server.url, model="manylangs")
    try:
        got, empty = elmo.embed_batch([sentences[0], []])
    finally:
        elmo.close()
    assert empty.shape == (3, 0, 16)  # that model's shape, not the default's (3, 0, 256)
    assert max_error([got], engines["manylangs"].run([sentences[0]])) <= TOLERANCE
    elmo = ElmoEmbedder(url=server.url, model="nope")
    with pytest.raises(ElmoError, match="unknown model 'nope'") as raised:
        elmo.embed_batch([[]])  # asks the server nothing but /info
    elmo.close()
    assert raised.value.status == 404


def test_no_request_failed_on_the_server(client, server):
    """Last: nothing above made the server answer 5xx (but the flooded one's 503s, on another server) or log a
    traceback."""
    statuses = {s for s in ("500", "502", "503") if counter(client, "elmo_requests_total", status=s)}
    assert not statuses and "Traceback" not in server.log.read_text()
