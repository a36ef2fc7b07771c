"""ELMoForManyLangs' model folders (HIT-SCIR, 44 languages), read into the project's BiLM, and written (random
weights, for tests and benchmarks: no model can be downloaded here).

A folder holds:

    config.json             the training run's options; its `config_path` names the architecture's JSON
    <config_path>           encoder {projection_dim, dim, n_layers, cell_clip, proj_clip}, token_embedder
                            {name: cnn, activation, filters, n_highway, char_dim, word_dim, max_characters_per_token}
    char.dic, word.dic      `entry<TAB>id` per line (service/text/token_ids.py reads them as the package does)
    token_embedder.pkl      torch state dict: char_emb_layer.embedding.weight (n_chars, char_dim),
                            word_emb_layer.embedding.weight (n_words, word_dim), convolutions.{i}.weight/bias,
                            highways._layers.{k}.weight (2F, F) and bias: [nonlinear; gate],
                            projection.weight (P, word_dim + F) and bias
    encoder.pkl             torch state dict, per layer l and direction d in (forward, backward):
                            {d}_layer_{l}.input_linearity.weight (4C, P), .state_linearity.weight (4C, P) and
                            .bias (4C,), .state_projection.weight (P, C); gates in the order i, f, g, o

What differs from the published layout, and how it maps onto BiLM (the same math):
* the highway's gate carries the input: y = g * x + (1 - g) * relu(A x), g = sigmoid(B x); BiLM's carry gate is
  1 - g = sigmoid(-B x), so B's rows and bias are negated;
* the LSTM gates are i, f, g, o with no forget bias added at run time; BiLM's are i, j (= g), f, o and it adds
  FORGET_BIAS, so the blocks are reordered and FORGET_BIAS is taken off the f bias;
* residual connections from layer 2 on always; a word vector before the projection (BiLM's `word_embed`).

The package's LSTM is stateful (each batch starts from where the previous one ended); like the rest of this
project the export is stateless: every sentence starts from the zero state, as the package's first batch after
loading does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from model_export.bilm import FORGET_BIAS, BiLM
from model_export.options import BiLMOptions

SPECIAL_CHARS = ("<bos>", "<eos>", "<oov>", "<pad>", "<bow>", "<eow>")
SPECIAL_WORDS = ("<oov>", "<bos>", "<eos>", "<pad>")
# The architecture of every released model, which some folders name without holding (the package falls back on
# its own copy of it): 2 layers of 4096 cells projected to 512, the char-CNN of the published ELMo.
RELEASED_ARCHITECTURE = {
    "encoder": {"name": "elmo", "projection_dim": 512, "cell_clip": 3, "proj_clip": 3, "dim": 4096, "n_layers": 2},
    "token_embedder": {
        "name": "cnn",
        "activation": "relu",
        "filters": [[1, 32], [2, 32], [3, 64], [4, 128], [5, 256], [6, 512], [7, 1024]],
        "n_highway": 2,
        "word_dim": 100,
        "char_dim": 50,
        "max_characters_per_token": 50,
    },
}
RELEASED_CONFIG_NAMES = ("cnn_50_100_512_4096_sample.json", "cnn_0_100_512_4096_sample.json")
GATES = [0, 2, 1, 3]  # i, f, g, o -> BiLM's i, j, f, o


def is_manylangs(folder: str | Path) -> bool:
    folder = Path(folder)
    return all((folder / name).is_file() for name in ("config.json", "char.dic", "token_embedder.pkl", "encoder.pkl"))


def read_architecture(folder: str | Path) -> dict:
    """The architecture JSON that the folder's config.json names (looked for where the package looks)."""
    folder = Path(folder)
    try:
        named = json.loads((folder / "config.json").read_text(encoding="utf-8"))["config_path"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{folder}/config.json: no config_path ({type(err).__name__}: {err})") from None
    for candidate in (folder / named, folder / Path(named).name):
        if candidate.is_file():
            return json.loads(candidate.read_text(encoding="utf-8"))
    if Path(named).name in RELEASED_CONFIG_NAMES:
        return RELEASED_ARCHITECTURE
    raise ValueError(f"{folder}: config.json names {named!r}, which is not in the folder")


def options_of(architecture: dict, n_chars: int, n_words: int) -> BiLMOptions:
    encoder, embedder = architecture["encoder"], architecture["token_embedder"]
    if embedder.get("name", "").lower() != "cnn" or encoder.get("name", "").lower() != "elmo":
        raise ValueError(
            f"token embedder {embedder.get('name')!r} with encoder {encoder.get('name')!r}: only the char-CNN "
            "token embedder with the ELMo encoder (every released model) can be exported"
        )
    if not embedder["char_dim"] > 0:
        raise ValueError("char_dim 0 (a model without characters) cannot be exported")
    return BiLMOptions(
        char_dim=int(embedder["char_dim"]),
        filters=tuple((int(w), int(n)) for w, n in embedder["filters"]),
        n_highway=int(embedder["n_highway"]),
        activation=embedder["activation"],
        n_characters=n_chars,
        max_chars=int(embedder["max_characters_per_token"]),
        n_layers=int(encoder["n_layers"]),
        cell_dim=int(encoder["dim"]),
        proj_dim=int(encoder["projection_dim"]),
        cell_clip=float(encoder["cell_clip"]) if encoder.get("cell_clip") else None,
        proj_clip=float(encoder["proj_clip"]) if encoder.get("proj_clip") else None,
        skip_connections=True,
        char_vocab=n_chars,
        word_vocab=n_words if embedder["word_dim"] > 0 else 0,
        word_dim=int(embedder["word_dim"]),
    )


def _state_dict(path: Path) -> dict[str, torch.Tensor]:
    try:  # tensors only: a pickle cannot run code this way
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(f"{path}: not a torch state dict ({type(err).__name__}: {err})") from None


def load_manylangs(folder: str | Path) -> BiLM:
    """The BiLM of an ELMoForManyLangs folder, in eval mode (the zero initial state)."""
    folder = Path(folder)
    architecture = read_architecture(folder)
    embedder = _state_dict(folder / "token_embedder.pkl")
    encoder = _state_dict(folder / "encoder.pkl")

    def get(state: dict, name: str) -> torch.Tensor:
        if name not in state:
            raise ValueError(f"{folder}: {name} is missing (not an ELMoForManyLangs model of this architecture?)")
        return state[name].float()

    chars = get(embedder, "char_emb_layer.embedding.weight")
    words = embedder.get("word_emb_layer.embedding.weight")
    opt = options_of(architecture, len(chars), 0 if words is None else len(words))
    model = BiLM(opt)
    enc = model.token_encoder
    f = opt.n_filters
    with torch.no_grad():
        _copy(enc.char_embed.weight, chars, "char_emb_layer.embedding.weight")
        if enc.word_embed is not None:
            _copy(enc.word_embed.weight, get(embedder, "word_emb_layer.embedding.weight"), "word_emb_layer")
        for i, conv in enumerate(enc.convs):
            _copy(conv.weight, get(embedder, f"convolutions.{i}.weight"), f"convolutions.{i}.weight")
            _copy(conv.bias, get(embedder, f"convolutions.{i}.bias"), f"convolutions.{i}.bias")
        for k, highway in enumerate(enc.highways):
            weight, bias = get(embedder, f"highways._layers.{k}.weight"), get(embedder, f"highways._layers.{k}.bias")
            sign = torch.cat([torch.ones(f), -torch.ones(f)])  # the gate's rows negated: carry = 1 - g
            _copy(highway.weight, weight * sign[:, None], f"highways._layers.{k}.weight")
            _copy(highway.bias, bias * sign, f"highways._layers.{k}.bias")
        _copy(enc.proj.weight, get(embedder, "projection.weight"), "projection.weight")
        _copy(enc.proj.bias, get(embedder, "projection.bias"), "projection.bias")
        for direction, stack in (("forward", model.forward_lstm), ("backward", model.backward_lstm)):
            for layer_index, cell in enumerate(stack.layers):
                name = f"{direction}_layer_{layer_index}"
                bias = _gates(get(encoder, f"{name}.state_linearity.bias"), opt.cell_dim)
                bias[2 * opt.cell_dim : 3 * opt.cell_dim] -= FORGET_BIAS  # BiLM adds it back at run time
                _copy(cell.w_input, _gates(get(encoder, f"{name}.input_linearity.weight"), opt.cell_dim).T, name)
                _copy(cell.w_hidden, _gates(get(encoder, f"{name}.state_linearity.weight"), opt.cell_dim).T, name)
                _copy(cell.bias, bias, f"{name}.state_linearity.bias")
                _copy(cell.w_proj, get(encoder, f"{name}.state_projection.weight").T, name)
    return model.eval()


def _gates(value: torch.Tensor, cells: int) -> torch.Tensor:
    """Rows in the gate order i, f, g, o -> i, g, f, o (BiLM's i, j, f, o)."""
    return torch.cat([value[k * cells : (k + 1) * cells] for k in GATES]).clone()


def _copy(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise ValueError(f"{name}: shape {tuple(value.shape)} in the model file, {tuple(param.shape)} expected")
    param.copy_(value)


MAPPING_FILES = ("char.dic", "word.dic")


def copy_mapping(folder: str | Path, out_dir: str | Path, has_words: bool) -> dict:
    """Copy the dictionaries the service maps tokens with next to the exported graph; the manifest's
    `token_mapping`."""
    for name in MAPPING_FILES[: 1 + has_words]:
        shutil.copyfile(Path(folder) / name, Path(out_dir) / name)
    return {"family": "elmoformanylangs", "chars": "char.dic", "words": "word.dic" if has_words else None}


def write_random_manylangs(
    folder: str | Path, architecture: dict, chars: list[str], words: list[str], seed: int = 0
) -> None:
    """An ELMoForManyLangs folder with random weights in its layout (what the package's training writes), with
    the given characters and words (the special entries are added first, as its training adds them)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    embedder, encoder = architecture["token_embedder"], architecture["encoder"]
    char_ids = {c: i for i, c in enumerate(dict.fromkeys([*chars, *SPECIAL_CHARS]))}
    word_ids = {w: i for i, w in enumerate(dict.fromkeys([*SPECIAL_WORDS, *words]))}
    _write_dictionary(folder / "char.dic", char_ids)
    if embedder["word_dim"] > 0:
        _write_dictionary(folder / "word.dic", word_ids)
    (folder / "config.json").write_text(json.dumps({"config_path": "architecture.json", "seed": seed}))
    (folder / "architecture.json").write_text(json.dumps(architecture, indent=1))

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    f = sum(n for _, n in embedder["filters"])
    p, c, d = encoder["projection_dim"], encoder["dim"], embedder["char_dim"]
    state = {"char_emb_layer.embedding.weight": normal(len(char_ids), d, std=1.0)}
    if embedder["word_dim"] > 0:
        state["word_emb_layer.embedding.weight"] = normal(len(word_ids), embedder["word_dim"], std=0.5)
    for i, (width, n) in enumerate(embedder["filters"]):
        state[f"convolutions.{i}.weight"] = normal(n, d, width, std=(d * width) ** -0.5)
        state[f"convolutions.{i}.bias"] = normal(n, std=0.1)
    for k in range(embedder["n_highway"]):
        state[f"highways._layers.{k}.weight"] = normal(2 * f, f, std=f**-0.5)
        state[f"highways._layers.{k}.bias"] = normal(2 * f, std=0.1)
    state["projection.weight"] = normal(p, embedder["word_dim"] + f, std=(embedder["word_dim"] + f) ** -0.5)
    state["projection.bias"] = normal(p, std=0.1)
    torch.save(state, folder / "token_embedder.pkl")
    layers = {}
    for layer_index in range(encoder["n_layers"]):
        for direction in ("forward", "backward"):
            name = f"{direction}_layer_{layer_index}"
            layers[f"{name}.input_linearity.weight"] = normal(4 * c, p, std=p**-0.5)
            layers[f"{name}.state_linearity.weight"] = normal(4 * c, p, std=p**-0.5)
            layers[f"{name}.state_linearity.bias"] = normal(4 * c, std=0.1)
            layers[f"{name}.state_projection.weight"] = normal(p, c, std=c**-0.5)
    torch.save(layers, folder / "encoder.pkl")


def _write_dictionary(path: Path, ids: dict[str, int]) -> None:
    path.write_text("".join(f"{entry}\t{i}\n" for entry, i in ids.items()), encoding="utf-8")
