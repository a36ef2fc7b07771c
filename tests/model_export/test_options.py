import json

import pytest

from model_export.options import BiLMOptions, load_options
from tests.conftest import CONFIGS


def test_published_full_size_architecture():
    opt = load_options(CONFIGS / "elmo_2x4096_512_2048cnn_2xhighway_options.json")
    assert (opt.n_layers, opt.cell_dim, opt.proj_dim, opt.n_filters, opt.n_highway) == (2, 4096, 512, 2048, 2)
    assert opt.output_dim == 1024 and opt.num_output_layers == 3
    # about 102 M multiply-adds per token (bench/configs/README.md)
    assert 101e6 < opt.macs_per_token() < 103e6


def test_round_trip_through_published_dict(tiny_dir):
    raw = json.loads((tiny_dir / "options.json").read_text())
    opt = BiLMOptions.from_dict(raw)
    assert BiLMOptions.from_dict(opt.to_dict()) == opt
    assert opt.to_dict()["lstm"]["use_skip_connections"] is True


def test_unknown_activation_is_refused(tiny_dir):
    raw = json.loads((tiny_dir / "options.json").read_text())
    raw["char_cnn"]["activation"] = "gelu"
    with pytest.raises(ValueError, match="activation"):
        BiLMOptions.from_dict(raw)
