"""The published hdf5 layout: read, written, and read back identically."""

import h5py
import numpy as np
import pytest
import torch

from model_export.bilm import BiLM
from model_export.options import load_options
from model_export.weights import load_bilm, load_published_weights, random_bilm, write_published_weights


def datasets(path) -> dict[str, np.ndarray]:
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[...]) if isinstance(obj, h5py.Dataset) else None)
    return out


def test_written_file_equals_the_published_file(tiny_dir, tmp_path):
    model = load_bilm(tiny_dir / "options.json", tiny_dir / "lm_weights.hdf5")
    write_published_weights(model, tmp_path / "weights.hdf5")
    original, written = datasets(tiny_dir / "lm_weights.hdf5"), datasets(tmp_path / "weights.hdf5")
    assert sorted(written) == sorted(original)
    for name, value in original.items():
        assert written[name].dtype == np.float32
        np.testing.assert_array_equal(written[name], value, err_msg=name)


def test_random_model_round_trips(tiny_dir, tmp_path):
    opt = load_options(tiny_dir / "options.json")
    model = random_bilm(opt, seed=3)
    write_published_weights(model, tmp_path / "w.hdf5")
    loaded = BiLM(opt)
    load_published_weights(loaded, tmp_path / "w.hdf5")
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_shape_mismatch_names_the_dataset(tiny_dir, tmp_path):
    opt = load_options(tiny_dir / "options.json")
    wrong = BiLM(type(opt)(**{**opt.__dict__, "cell_dim": 32}))
    with pytest.raises(ValueError, match="W_0"):
        load_published_weights(wrong, tiny_dir / "lm_weights.hdf5")


def test_missing_dataset_is_reported(tmp_path, tiny_dir):
    with h5py.File(tmp_path / "empty.hdf5", "w") as f:
        f.create_dataset("something", data=np.zeros(1))
    with pytest.raises(ValueError, match="char_embed"):
        load_published_weights(BiLM(load_options(tiny_dir / "options.json")), tmp_path / "empty.hdf5")
