"""The ONNX Runtime engine: feeds, providers, shapes."""

import numpy as np
import pytest

from service.chars import token_char_ids
from service.engine import Engine, choose_providers, encode_batch


def test_feeds_hold_each_distinct_token_once():
    feeds = encode_batch([["a", "b", "a"], ["b"]], max_chars=50)
    # <S>, </S>, a, b
    assert feeds["token_chars"].shape == (4, 50)
    np.testing.assert_array_equal(feeds["token_chars"][2], token_char_ids("a"))
    assert feeds["token_index"].tolist() == [[0, 2, 3, 2, 1], [0, 3, 1, 0, 0]]
    assert feeds["lengths"].tolist() == [5, 3]


def test_outputs_are_per_sentence_without_boundaries(engine):
    out = engine.run([["one"], ["two", "words", "here"]])
    assert [o.shape for o in out] == [(3, 1, 32), (3, 3, 32)]
    assert all(o.dtype == np.float32 and o.flags.c_contiguous for o in out)
    assert engine.run([]) == []


def test_empty_sentence_gives_no_rows(engine):
    assert engine.run([[], ["x"]])[0].shape == (3, 0, 32)


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


def test_missing_model_folder_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="elmo-export"):
        Engine(tmp_path)
