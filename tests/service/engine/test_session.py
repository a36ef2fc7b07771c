"""The ONNX Runtime engine: feeds, providers, shapes."""

import json
import re
import shutil

import numpy as np
import pytest

from service.engine.feeds import encode_windows, sentence_keys
from service.engine.providers import check_single_runtime, choose_providers
from service.engine.session import Engine
from service.engine.token_cache import TokenCache
from service.manifest import GRAPH_VERSION, read_manifest
from service.text.chars import token_char_ids
from service.text.token_ids import BilmTfMapping

BYTES = BilmTfMapping(50)  # the published byte mapping


def whole(*sentences) -> list:
    """Windows covering each whole sentence, as Engine.run feeds them."""
    keys = [sentence_keys(s, BYTES) for s in sentences]
    return [(k, 0, len(k)) for k in keys]


def test_feeds_hold_each_distinct_token_once():
    feeds, encoded = encode_windows(whole(["a", "b", "a"], ["b"]), mapping=BYTES, dim=16)
    # <S>, a, b, </S>: keyed by what their char ids depend on (see char_key)
    assert encoded == {"<S>": 0, b"a": 1, b"b": 2, "</S>": 3}
    assert feeds["token_chars"].shape == (4, 50) and feeds["cached_vectors"].shape == (0, 16)
    np.testing.assert_array_equal(feeds["token_chars"][1], token_char_ids("a"))
    assert feeds["index_fwd"].tolist() == [[0, 1, 2, 1, 3], [0, 2, 3, 0, 0]]
    assert feeds["index_bwd"].tolist() == [[3, 1, 2, 1, 0], [3, 2, 0, 0, 0]]  # each sentence reversed
    assert feeds["lengths"].tolist() == [5, 3]


def test_a_window_reads_its_positions_forward_and_in_the_sentence_reversed():
    keys = sentence_keys(["a", "b", "c", "d"], BYTES)  # <S> a b c d </S>
    feeds, encoded = encode_windows([(keys, 2, 3)], mapping=BYTES, dim=16)
    names = {row: key for key, row in encoded.items()}
    assert [names[i] for i in feeds["index_fwd"][0]] == [b"b", b"c", b"d"]  # positions 2, 3, 4
    assert [names[i] for i in feeds["index_bwd"][0]] == [b"c", b"b", b"a"]  # reversed positions 2, 3, 4


def test_cached_tokens_are_not_encoded_again():
    cache = TokenCache(10)
    cache.put(b"b", np.full(16, 7, np.float32))
    feeds, encoded = encode_windows(whole(["a", "b", "a"], ["b"]), mapping=BYTES, dim=16, cache=cache)
    assert encoded == {"<S>": 0, b"a": 1, "</S>": 2}  # "b" comes from the cache, after the 3 encoded rows
    assert feeds["cached_vectors"].tolist() == [[7.0] * 16]
    assert feeds["index_fwd"].tolist() == [[0, 1, 3, 1, 2], [0, 3, 2, 0, 0]]


def test_a_window_of_cached_tokens_still_encodes_a_row():
    cache = TokenCache(10)
    cache.put(b"a", np.full(16, 7, np.float32))
    feeds, encoded = encode_windows([(sentence_keys(["a", "a"], BYTES), 1, 2)], mapping=BYTES, dim=16, cache=cache)
    assert len(encoded) == 1 and feeds["token_chars"].shape == (1, 50)  # the graph's char-CNN needs a row
    assert feeds["index_fwd"].tolist() == [[1, 1]]


def test_tokens_alike_in_their_kept_bytes_are_encoded_once():
    # A million characters cost the feeds and the cache 48 bytes: the mapping keeps no more.
    huge, other = "x" * 1_000_000, "x" * 48 + "tail"
    feeds, encoded = encode_windows(whole([huge, other, "<S>"]), mapping=BYTES, dim=16)
    assert encoded == {"<S>": 0, b"x" * 48: 1, "</S>": 2}  # a "<S>" token is the boundary, as published
    np.testing.assert_array_equal(feeds["token_chars"][1], token_char_ids(huge))
    assert feeds["index_fwd"].tolist() == [[0, 1, 1, 0, 2]]


def test_a_huge_token_is_cached_by_its_kept_bytes(tiny_model_dir):
    engine = Engine(tiny_model_dir, provider="cpu", token_cache=10)
    huge = "é" * 500_000  # 1e6 bytes; 48 kept
    (got,) = engine.run([[huge, "end"]])
    assert len(engine.token_cache) == 2 and engine.token_cache.get("é".encode() * 24) is not None
    np.testing.assert_array_equal(got, engine.run([["é" * 24, "end"]])[0])


def test_cache_is_bounded_least_recent_out():
    cache = TokenCache(2)
    for token in "abc":
        cache.put(token, np.zeros(1, np.float32))
    assert len(cache) == 2 and cache.get("a") is None
    cache.get("b")  # b is now more recent than c
    cache.put("d", np.zeros(1, np.float32))
    assert cache.get("c") is None and cache.get("b") is not None


def test_cache_changes_no_bit_and_earlier_requests_change_nothing(tiny_model_dir, sentences):
    fresh = Engine(tiny_model_dir, provider="cpu", token_cache=0)
    cached = Engine(tiny_model_dir, provider="cpu", token_cache=1000)
    cached.run(sentences[10:])  # fills the cache with the words of other sentences
    assert len(cached.token_cache) > 100
    for want, got in zip(fresh.run(sentences[:10]), cached.run(sentences[:10]), strict=True):
        np.testing.assert_array_equal(got, want)
    for s in sentences[:3]:  # alone (few rows to encode) and cached: the same bits again
        np.testing.assert_array_equal(cached.run([s])[0], fresh.run([s])[0])


def test_outputs_are_per_sentence_without_boundaries(engine):
    out = engine.run([["one"], ["two", "words", "here"]])
    assert [o.shape for o in out] == [(3, 1, 32), (3, 3, 32)]
    assert all(o.dtype == np.float32 and o.flags.c_contiguous for o in out)
    assert engine.run([]) == []


def test_empty_sentence_gives_no_rows(engine):
    assert engine.run([[], ["x"]])[0].shape == (3, 0, 32)


@pytest.mark.parametrize("graph", ["loop", "window"])
def test_boundaries_are_the_bilms_own_positions_and_change_no_other(tiny_model_dir, tiny_bilm, sentences, graph):
    # <S> and </S> as the biLM computes them (allennlp's keep_sentence_boundaries): the torch biLM the graphs are
    # exported from, on every position of `<S> tokens </S>`; the tokens' positions the very bits of a run without them
    import torch

    from service.text.chars import sentence_char_ids

    engine = Engine(tiny_model_dir, provider="cpu", graph=graph, intra_op_threads=2)
    batch = [*sentences[:6], [], ["x"]]
    kept, cut = engine.run(batch, boundaries=True), engine.run(batch)
    for tokens, with_, without in zip(batch, kept, cut, strict=True):
        assert with_.shape == (3, len(tokens) + 2, 32) and with_.dtype == np.float32
        np.testing.assert_array_equal(with_[:, 1:-1], without)
        chars = torch.from_numpy(sentence_char_ids(tokens).astype(np.int64))[None]
        with torch.no_grad():
            want = tiny_bilm(chars)[:, 0].numpy()
        assert float(np.abs(with_ - want).max()) <= 1e-5 and float(np.abs(with_[1:, [0, -1]]).max()) > 0.01


def test_cpu_provider_here():
    assert choose_providers("cpu") == ["CPUExecutionProvider"]
    assert choose_providers("auto")[-1] == "CPUExecutionProvider"
    with pytest.raises(ValueError, match="provider"):
        choose_providers("tpu")


def test_cuda_provider_asked_for_without_a_gpu(monkeypatch):
    # No GPU on the CI machine: pretend the CUDA build is missing and check the message, not a crash later.
    monkeypatch.setattr("onnxruntime.get_available_providers", lambda: ["CPUExecutionProvider"])
    with pytest.raises(RuntimeError, match="cuda"):
        choose_providers("cuda")


@pytest.mark.filterwarnings("ignore:Specified provider")
def test_cuda_asked_for_but_not_started_is_refused(tiny_model_dir, monkeypatch):
    # onnxruntime-gpu that lists CUDA but cannot start it (no GPU visible) falls back to the CPU: refuse that.
    monkeypatch.setattr(
        "service.engine.providers.choose_providers", lambda _: ["CUDAExecutionProvider", "CPUExecutionProvider"]
    )
    with pytest.raises(RuntimeError, match="fell back to CPUExecutionProvider"):
        Engine(tiny_model_dir, provider="cuda")


def test_missing_model_folder_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="elmo-export"):
        Engine(tmp_path)


def test_cpu_and_gpu_runtimes_together_are_refused(monkeypatch):
    check_single_runtime()  # this environment has exactly one
    monkeypatch.setattr("service.engine.providers.metadata.version", lambda name: "1.0")  # pretend both are installed
    with pytest.raises(RuntimeError, match="onnxruntime-gpu"):
        check_single_runtime()


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        ('{"num_layers": 3,', "not a manifest written by elmo-export (JSONDecodeError"),
        ('{"num_layers": 3}', "not a manifest written by elmo-export (no 'output_dim')"),
        ("[1, 2]", "not a manifest written by elmo-export (TypeError"),
    ],
)
def test_a_broken_manifest_says_what_is_wrong(tmp_path, manifest, message):
    (tmp_path / "manifest.json").write_text(manifest)
    with pytest.raises(ValueError, match=re.escape(message)):
        read_manifest(tmp_path)


@pytest.mark.filterwarnings("ignore:Specified provider")
def test_auto_without_a_usable_gpu_serves_the_cpus_graph(tiny_model_dir, engine, monkeypatch):
    # onnxruntime-gpu on a host whose GPU cannot start: "auto" falls back to the CPU, and to the CPU's graph there
    # (the window graph's state store would be asked for on a device that is not there).
    monkeypatch.setattr(
        "service.engine.providers.choose_providers", lambda _: ["CUDAExecutionProvider", "CPUExecutionProvider"]
    )
    fallen = Engine(tiny_model_dir, provider="auto")
    assert (fallen.provider, fallen.device, fallen.graph.kind) == ("CPUExecutionProvider", "cpu", "loop")
    np.testing.assert_array_equal(fallen.run([["still", "exact"]])[0], engine.run([["still", "exact"]])[0])


def test_an_export_of_graph_version_6_is_still_served(tiny_model_dir, engine, sentences, tmp_path):
    """Version 6 wrote no token_mapping nor tokenizer: the same graph, the published byte mapping, English."""
    old = tmp_path / "v6"
    shutil.copytree(tiny_model_dir, old)
    manifest = json.loads((old / "manifest.json").read_text())
    assert manifest["graph_version"] == GRAPH_VERSION
    manifest["graph_version"] = 6
    del manifest["token_mapping"], manifest["tokenizer"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    served = Engine(old, provider="cpu", intra_op_threads=1)
    assert (served.mapping.family, served.info.language) == ("bilm-tf", "en")
    for got, want in zip(served.run(sentences[:5]), engine.run(sentences[:5]), strict=True):
        np.testing.assert_array_equal(got, want)
    # Its window graph is of the kind before rows were packed: the engine refuses to feed it, and says why.
    with pytest.raises(ValueError, match=r"window graph is of graph version 6.*export it again"):
        Engine(old, provider="cpu", graph="window")
