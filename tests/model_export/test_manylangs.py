"""ELMoForManyLangs models: read, exported and served, against the numbers of HIT-SCIR's own package.

The fixture (tests/fixtures/elmoformanylangs-tiny, its README says how it was made) is a model with random weights
in the package's layout, and the layers that elmoformanylangs 0.0.4.post2 computed for its sentences: characters
and words outside the model's dictionaries, a token over max_characters_per_token, an empty token, the package's
boundary spellings, and U+3000, which its dictionary reader treats apart."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from model_export.export import export_manylangs, torch_layers
from model_export.manylangs import load_manylangs, options_of, read_architecture, write_random_manylangs
from service.engine.session import Engine
from service.manifest import read_manifest
from service.text.token_ids import ManyLangsMapping, read_dictionary
from tests.conftest import max_error
from tests.live_server import running_server

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "elmoformanylangs-tiny"
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def sentences() -> list[list[str]]:
    return json.loads((FIXTURE / "sentences.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def package_layers() -> list[np.ndarray]:
    """elmoformanylangs' layers (L+1, tokens, 2P) of each fixture sentence, from its first batch after loading."""
    data = np.load(FIXTURE / "expected_layers.npz")
    return [data[f"s{i}"] for i in range(len(json.loads((FIXTURE / "sentences.json").read_text(encoding="utf-8"))))]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("manylangs-onnx")
    export_manylangs(FIXTURE, out, language="de")
    return out


def test_the_fixture_is_not_trivial(package_layers, sentences):
    assert [a.shape for a in package_layers] == [(3, len(s), 16) for s in sentences]
    values = np.concatenate([a.ravel() for a in package_layers])
    assert values.std() > 0.1  # random weights that still move the numbers
    # the package's LSTM is stateful: the same sentences sent again come out otherwise (README of the fixture)
    assert float(np.load(FIXTURE / "expected_layers.npz")["second_call_max_abs_diff"]) > 1e-2


def test_the_torch_biLM_equals_the_package(sentences, package_layers, exported):
    model = load_manylangs(FIXTURE)
    assert max_error(torch_layers(model, sentences, read_manifest(exported).mapping), package_layers) <= TOLERANCE


@pytest.mark.parametrize("graph", ["loop", "window"])
def test_the_exported_graphs_equal_the_package(sentences, package_layers, exported, graph):
    engine = Engine(exported, provider="cpu", graph=graph, intra_op_threads=1)
    error = max_error(engine.run(sentences), package_layers)
    assert error <= TOLERANCE
    # a sentence alone is the same bits as in the batch (its vectors never depend on the others)
    alone = [engine.run([s])[0] for s in sentences]
    assert max_error(alone, engine.run(sentences)) == 0.0


def test_the_manifest_names_the_mapping_and_its_files(exported):
    manifest = json.loads((exported / "manifest.json").read_text())
    assert manifest["token_mapping"] == {"family": "elmoformanylangs", "chars": "char.dic", "words": "word.dic"}
    assert manifest["tokenizer"] == {"name": "moses", "language": "de"}
    assert (exported / "char.dic").read_bytes() == (FIXTURE / "char.dic").read_bytes()
    assert set(manifest["sources"]) >= {"token_embedder.pkl", "encoder.pkl", "char.dic", "word.dic"}
    assert manifest["architecture"]["word_embedding"] == {"vocab": 13, "dim": 6}
    assert manifest["parity"]["max_abs_error"] <= TOLERANCE


# -- the mapping, quirk by quirk ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mapping() -> ManyLangsMapping:
    return ManyLangsMapping(read_dictionary(FIXTURE / "char.dic"), read_dictionary(FIXTURE / "word.dic"), 50)


def test_a_token_is_its_characters_between_the_swapped_word_marks(mapping):
    chars, words = mapping.chars, mapping.words
    row = mapping.row(mapping.key("café"))
    assert row.shape == (51,)  # 50 char ids, then the word id
    # the package reads '<eow>' into its begin-of-word id and '<bow>' into its end-of-word id
    assert list(row[:6]) == [chars["<eow>"], chars["c"], chars["a"], chars["f"], chars["é"], chars["<bow>"]]
    assert set(row[6:50]) == {chars["<pad>"]} and row[50] == words["café"]


def test_unknown_characters_and_words_are_oov(mapping):
    row = mapping.row(mapping.key("日本"))
    assert list(row[1:3]) == [mapping.chars["<oov>"]] * 2 and row[-1] == mapping.words["<oov>"]


def test_a_long_token_is_cut_to_its_first_characters_not_bytes(mapping):
    token = "é" * 60  # 120 UTF-8 bytes
    assert mapping.key(token) == "é" * 48 and mapping.kept(token) == (120, 96)
    assert mapping.key("x" * 48 + "tail") == mapping.key("x" * 48)  # what the package reads of both


def test_the_boundaries_and_their_spellings_in_text(mapping):
    assert mapping.boundaries == ("<bos>", "<eos>")
    row = mapping.row("<bos>")
    assert list(row[:3]) == [mapping.chars["<eow>"], mapping.chars["<bos>"], mapping.chars["<bow>"]]
    assert row[-1] == mapping.words["<bos>"]
    # "<S>" is an ordinary token to this family
    assert mapping.row(mapping.key("<S>"))[1] == mapping.chars["<oov>"]


def test_dictionaries_are_read_as_the_package_reads_them(tmp_path):
    path = tmp_path / "char.dic"
    path.write_text("a\t0\n\u3000\t1\n b \t2\na\t3\n", encoding="utf-8")
    # the line's ends are stripped first: U+3000 alone becomes an id alone, which stands for U+3000; a space inside
    # the line stays; a later line wins
    assert read_dictionary(path) == {"a": 3, "\u3000": 1, "b ": 2}
    # lines end where its reader (codecs.open) ends them, at \x1c too: "12" alone is U+3000's id
    path.write_text("12\x1c34\t5\n", encoding="utf-8")
    assert read_dictionary(path) == {"\u3000": 12, "34": 5}
    path.write_text("a\t0\nno id here\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"char\.dic:2"):
        read_dictionary(path)


def test_a_dictionary_without_the_special_entries_is_refused():
    with pytest.raises(ValueError, match="<bow>"):
        ManyLangsMapping({"a": 0, "<oov>": 1, "<pad>": 2}, None, 50)


def test_other_architectures_are_refused_by_name():
    lstm = {"encoder": {"name": "elmo"}, "token_embedder": {"name": "lstm", "char_dim": 50}}
    with pytest.raises(ValueError, match="'lstm'"):
        options_of(lstm, 10, 10)


def test_a_model_without_word_table_exports_and_agrees(tmp_path, sentences):
    architecture = json.loads((FIXTURE / "architecture.json").read_text())
    architecture["token_embedder"]["word_dim"] = 0
    write_random_manylangs(tmp_path / "m", architecture, list("abcdefghijklmnopqrstuvwxyz"), [], seed=3)
    manifest = export_manylangs(tmp_path / "m", tmp_path / "out")
    assert manifest["token_mapping"]["words"] is None and not (tmp_path / "out" / "word.dic").exists()
    engine = Engine(tmp_path / "out", provider="cpu", intra_op_threads=1)
    assert engine.mapping.width == 50
    want = torch_layers(load_manylangs(tmp_path / "m"), sentences, engine.mapping)
    assert max_error(engine.run(sentences), want) <= TOLERANCE


def test_the_architecture_is_found_where_the_package_looks(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"config_path": "/somewhere/else/cnn_50_100_512_4096_sample.json"})
    )
    assert read_architecture(tmp_path)["encoder"]["dim"] == 4096  # every released model's, named but not there
    (tmp_path / "config.json").write_text(json.dumps({"config_path": "/elsewhere/mine.json"}))
    (tmp_path / "mine.json").write_text(json.dumps({"encoder": {"dim": 7}}))
    assert read_architecture(tmp_path)["encoder"]["dim"] == 7  # its file name, in the folder
    (tmp_path / "config.json").write_text(json.dumps({"config_path": "missing.json"}))
    with pytest.raises(ValueError, match=r"missing\.json"):
        read_architecture(tmp_path)


# -- elmo-export ----------------------------------------------------------------------------------------------------


def export_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "model_export.cli", *args], capture_output=True, text=True)


def test_elmo_export_tells_the_layout_by_the_files(tmp_path):
    run = export_cli(str(FIXTURE), "--out", str(tmp_path / "auto"))
    assert run.returncode == 0, run.stderr
    assert read_manifest(tmp_path / "auto").mapping.family == "elmoformanylangs"
    run = export_cli(str(FIXTURE), "--format", "bilm-tf", "--out", str(tmp_path / "wrong"))
    assert run.returncode == 2 and "neither an ELMoForManyLangs folder" in run.stderr
    run = export_cli(str(FIXTURE), "--options", "x.json", "--out", str(tmp_path / "both"))
    assert run.returncode == 2 and "not both" in run.stderr
    run = export_cli(str(FIXTURE), "--language", "xx", "--out", str(tmp_path / "xx"))
    assert run.returncode == 2 and "Moses has rules for" in run.stderr and " de, " in run.stderr


def test_elmo_export_takes_a_published_folder_as_downloaded(tiny_dir, tmp_path):
    folder = tmp_path / "download"  # allennlp's file names
    folder.mkdir()
    shutil.copyfile(tiny_dir / "options.json", folder / "elmo_2x16_tiny_options.json")
    shutil.copyfile(tiny_dir / "lm_weights.hdf5", folder / "elmo_2x16_tiny_weights.hdf5")
    run = export_cli(str(folder), "--out", str(tmp_path / "out"))
    assert run.returncode == 0, run.stderr
    assert read_manifest(tmp_path / "out").mapping.family == "bilm-tf"


# -- served ---------------------------------------------------------------------------------------------------------


def test_served_over_http_with_the_package_numbers(exported, sentences, package_layers, tmp_path):
    with running_server(exported, tmp_path) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        answer = client.post("/embed", json={"sentences": sentences, "output": "layers", "encoding": "base64"})
        assert answer.status_code == 200, answer.text
        got = []
        for item in answer.json()["data"]:
            raw = np.frombuffer(base64.b64decode(item["embedding"]), np.float32)
            got.append(raw.reshape(item["shape"]))
        assert max_error(got, package_layers) <= TOLERANCE
        tokens = client.post("/tokenize", json={"sentences": [["é" * 60, "ok"], "Dr. Müller kam z.B. heute."]})
        body = tokens.json()
        assert body["token_cut"] == "the first 48 characters" and body["max_bytes_per_token"] is None
        assert body["data"][0]["utf8_bytes"] == [120, 2] and body["data"][0]["kept_bytes"] == [96, 2]
        # the model's language (German, at export) keeps "Dr." and "z.B." whole
        assert body["data"][1]["tokens"] == ["Dr.", "Müller", "kam", "z.B.", "heute", "."]
        info = client.get("/info").json()
        assert info["manifest"]["token_mapping"]["family"] == "elmoformanylangs"
