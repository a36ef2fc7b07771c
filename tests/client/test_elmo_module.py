"""elmo_client.elmo (the torch extra) against allennlp 2.10.1's own Elmo on the fixture model, run in the allennlp
environment (tests/allennlp_reference/elmo_module.py): the same character ids, masks and representations to 1e-5
with the same mix parameters and dropout seed, and the same gradients on the mix parameters; with layer norm (its
statistics over the sentence boundaries too, as allennlp's), with the boundaries kept, with a cached vocabulary's
word ids, and on long tokens cut inside a character; an allennlp Elmo's state loads strictly."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from elmo_client.allennlp import ConfigurationError  # noqa: E402 (after torch's importorskip)
from elmo_client.elmo import Elmo, batch_to_ids, ids_to_tokens  # noqa: E402

from tests.allennlp_reference import run_allennlp  # noqa: E402
from tests.live_server import running_server  # noqa: E402

MIXES = [[0.3, -0.2, 0.5, 1.7], [-1.0, 0.0, 2.0, 0.6]]  # per representation: the 3 weights (before softmax), gamma
# Tokens over 48 UTF-8 bytes whose 48th byte is inside a character (its first 1, 2 or 3 bytes kept), with the
# leads that constrain the next byte (E0, ED, F0), and others that batch_to_ids treats specially.
LONG = [
    ["x" * 47 + "ü", "y" * 46 + "€z", "w" * 45 + "😀", "a" * 47 + "😀", "u" * 47 + "\u0800", "t" * 47 + "\ud7ff"],
    ["v" * 47 + "𐍈", "中" * 17, "ä" * 25, "naïve", "", " ", "<S>", "</S>", "."],
    ["b" * 46 + "😀", "short"],
]
CASES = [
    {"name": "plain", "do_layer_norm": False, "dropout": 0.0, "seed": 1, "fixed": None, "mixes": MIXES},
    {"name": "layer_norm", "do_layer_norm": True, "dropout": 0.0, "seed": 1, "fixed": None, "mixes": MIXES},
    {"name": "dropout", "do_layer_norm": False, "dropout": 0.5, "seed": 7, "fixed": None, "mixes": MIXES},
    {"name": "fixed", "do_layer_norm": False, "dropout": 0.0, "seed": 1, "fixed": [0.1, 0.2, 0.7],
     "mixes": [[0.1, 0.2, 0.7, 1.0]]},
    {"name": "keep", "do_layer_norm": False, "dropout": 0.0, "seed": 1, "fixed": None, "mixes": MIXES,
     "keep_sentence_boundaries": True},
    {"name": "keep_layer_norm", "do_layer_norm": True, "dropout": 0.5, "seed": 3, "fixed": None, "mixes": MIXES,
     "keep_sentence_boundaries": True},
    {"name": "long", "do_layer_norm": False, "dropout": 0.0, "seed": 1, "fixed": None, "mixes": MIXES,
     "sentences": LONG},
    {"name": "vocab", "do_layer_norm": False, "dropout": 0.0, "seed": 1, "fixed": None, "mixes": MIXES},
]  # fmt: skip
OPTIONS = {"do_layer_norm", "dropout", "keep_sentence_boundaries"}  # what a case gives Elmo (and allennlp's)


def with_vocabulary(case: dict, sentences: list[list[str]]) -> dict:
    """The vocab case: allennlp's vocab_to_cache (padding and unknown first, as its Vocabulary has them) and the
    word ids of the sentences (0 past each one's end)."""
    vocab = ["@@PADDING@@", "@@UNKNOWN@@", *sorted({t for s in sentences for t in s})]
    index = {word: k for k, word in enumerate(vocab)}
    width = max(map(len, sentences))
    ids = [[index[t] for t in s] + [0] * (width - len(s)) for s in sentences]
    return {**case, "vocab_to_cache": vocab, "word_ids": ids}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("elmo-module")) as s:
        yield s


@pytest.fixture(scope="module")
def cases(sentences, tmp_path_factory) -> list[dict]:
    state = tmp_path_factory.mktemp("elmo-module-state") / "plain.pt"
    return [with_vocabulary(c, sentences) if c["name"] == "vocab" else {**c, "state": str(state)}
            if c["name"] == "plain" else c for c in CASES]  # fmt: skip


@pytest.fixture(scope="module")
def reference(tiny_dir, sentences, cases, tmp_path_factory):
    """allennlp's outputs and gradients, and the loss's targets (random, fixed by a seed)."""
    work = tmp_path_factory.mktemp("elmo-module-reference")
    rng = np.random.default_rng(0)
    shape = (len(sentences), max(map(len, sentences)) + 2, 32)  # room for the boundaries
    targets = {f"t{k}": rng.standard_normal(shape).astype(np.float32) for k in range(len(MIXES))}
    np.savez(work / "targets.npz", **targets)
    spec = {"options": str(tiny_dir / "options.json"), "weights": str(tiny_dir / "lm_weights.hdf5"),
            "sentences": sentences, "targets": str(work / "targets.npz"), "cases": cases}  # fmt: skip
    (work / "spec.json").write_text(json.dumps(spec))
    done = run_allennlp("elmo_module.py", str(work / "spec.json"), str(work / "out.npz"))
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(np.load(work / "out.npz")), [torch.from_numpy(t) for t in targets.values()]


def loss_of(representation, target):
    batch, timesteps = representation.shape[:2]
    return (representation * target[:batch, :timesteps]).sum()


def ours(case, server, sentences, targets, state=None):
    """The service-backed Elmo on the case: its output and the gradients of the same loss on each mix."""
    options = {k: v for k, v in case.items() if k in OPTIONS}
    elmo = Elmo(None, None, len(case["mixes"]), scalar_mix_parameters=case["fixed"], url=server.url,
                vocab_to_cache=case.get("vocab_to_cache"), **options)  # fmt: skip
    mixes = [getattr(elmo, f"scalar_mix_{k}") for k in range(len(case["mixes"]))]
    if state is not None:
        elmo.load_state_dict(state)  # strict
    else:
        with torch.no_grad():
            for mix, values in zip(mixes, case["mixes"], strict=True):
                for parameter, value in zip(mix.scalar_parameters, values[:-1], strict=True):
                    parameter.fill_(value)
                mix.gamma.fill_(values[-1])
    elmo.train(case["dropout"] > 0)
    torch.manual_seed(case["seed"])
    words = torch.tensor(case["word_ids"]) if "word_ids" in case else None
    result = elmo(batch_to_ids(case.get("sentences", sentences)), words)
    if case["fixed"] is None:  # fixed mix parameters: nothing to differentiate
        sum(loss_of(r, targets[k]) for k, r in enumerate(result["elmo_representations"])).backward()
    grads = [None if case["fixed"] else torch.cat([*(p.grad for p in m.scalar_parameters), m.gamma.grad]).numpy()
             for m in mixes]  # fmt: skip
    return result, grads


def relative(got: np.ndarray, want: np.ndarray) -> float:
    return float((np.abs(got - want) / np.maximum(1.0, np.abs(want))).max())


def assert_equal_to_allennlps(result, grads, want, name, sentences, capsys):
    assert set(result) == {"elmo_representations", "mask"} and result["mask"].dtype == torch.bool
    np.testing.assert_array_equal(result["mask"].numpy(), want[f"{name}/mask"])
    worst_out = worst_grad = 0.0
    for k, r in enumerate(result["elmo_representations"]):
        assert r.shape == want[f"{name}/rep{k}"].shape and r.dtype == torch.float32
        worst_out = max(worst_out, float(np.abs(r.detach().numpy() - want[f"{name}/rep{k}"]).max()))
        if grads[k] is not None:
            worst_grad = max(worst_grad, relative(grads[k], want[f"{name}/grad{k}"]))
    with capsys.disabled():
        print(f"\n{name}: outputs max abs error {worst_out:.3g}, mix gradients max relative error {worst_grad:.3g}")
    assert worst_out <= 1e-5 and worst_grad <= 1e-4


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_outputs_and_mix_gradients_equal_allennlps_elmo(case, cases, server, sentences, reference, capsys):
    want, targets = reference
    case = next(c for c in cases if c["name"] == case["name"])
    result, grads = ours(case, server, sentences, targets)
    assert_equal_to_allennlps(result, grads, want, case["name"], sentences, capsys)
    shape = list(want[f"{case['name']}/ids"].shape[:2])
    if case.get("keep_sentence_boundaries"):  # allennlp's test_elmo_keep_sentence_boundaries: 2 more positions
        shape[1] += 2
    assert list(result["mask"].shape) == shape


def test_word_inputs_of_a_cached_vocabulary_are_the_character_ids_layers(cases, server, sentences, reference):
    # allennlp's vocab_to_cache: layer 0 of the cached words, looked up by id; the result that of the characters
    _, targets = reference
    plain = next(c for c in cases if c["name"] == "plain")
    vocab = next(c for c in cases if c["name"] == "vocab")
    by_chars, _ = ours({**plain, "state": None}, server, sentences, targets)
    by_words, _ = ours(vocab, server, sentences, targets)
    # an id outside the vocabulary: the characters are read instead, as allennlp backs off to them
    outside = {**vocab, "word_ids": [[len(vocab["vocab_to_cache"]), *row[1:]] for row in vocab["word_ids"]]}
    by_chars_again, _ = ours(outside, server, sentences, targets)
    for a, b, c in zip(*(r["elmo_representations"] for r in (by_chars, by_words, by_chars_again)), strict=True):
        np.testing.assert_array_equal(a.detach().numpy(), b.detach().numpy())
        np.testing.assert_array_equal(a.detach().numpy(), c.detach().numpy())
    # 3-D word ids (allennlp's test_elmo_bilm_can_handle_higher_dimensional_input_with_cache): each slice the same
    elmo = Elmo(None, None, 1, dropout=0.0, vocab_to_cache=vocab["vocab_to_cache"], url=server.url)
    ids, words = batch_to_ids(sentences[:3]), torch.tensor(vocab["word_ids"])[:3, : max(map(len, sentences[:3]))]
    expanded = elmo(torch.stack([ids] * 2, dim=1), torch.stack([words] * 2, dim=1))["elmo_representations"][0]
    alone = elmo(ids, words)["elmo_representations"][0]
    assert expanded.shape == (3, 2, *alone.shape[1:])
    np.testing.assert_array_equal(expanded[:, 1].detach().numpy(), alone.detach().numpy())


def test_an_allennlp_elmos_state_loads_strictly_naming_the_biLM_keys_it_ignores(cases, server, sentences, reference,
                                                                                 capsys):  # fmt: skip
    want, targets = reference
    plain = next(c for c in cases if c["name"] == "plain")
    state = torch.load(plain["state"])
    bilm = [k for k in state if k.startswith("_elmo_lstm.")]
    assert len(bilm) == 33 and len(state) == 33 + 8  # allennlp's biLM, and two mixes of 3 weights and a gamma
    with pytest.warns(UserWarning, match=r"33 keys of allennlp's biLM ignored, _elmo_lstm\._token_embedder\.\* "):
        result, grads = ours(plain, server, sentences, targets, state=state)
    assert_equal_to_allennlps(result, grads, want, "plain", sentences, capsys)  # the mixes are allennlp's
    elmo = Elmo(None, None, 2, url=server.url)
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="Unexpected key"):  # strict for the mixes' keys
        elmo.load_state_dict({**state, "scalar_mix_2.gamma": torch.ones(1)})


def test_batch_to_ids_is_allennlps_and_goes_back_to_the_text_the_server_reads(sentences, reference):
    want, _ = reference
    ids = batch_to_ids(sentences)
    np.testing.assert_array_equal(ids.numpy(), want["plain/ids"])
    np.testing.assert_array_equal(batch_to_ids(LONG).numpy(), want["long/ids"])
    assert ids.dtype == torch.long and ids_to_tokens(ids) == sentences
    tricky = [["<S>", "</S>", "naïve", "ü" * 30], ["x" * 60], []]  # ü is 2 bytes: cut inside none of them at 48
    assert ids_to_tokens(batch_to_ids(tricky)) == [["<S>", "</S>", "naïve", "ü" * 24], ["x" * 48], []]
    # cut inside a character: the text sent completes it, so that its first 48 bytes are the ids' own
    for sentence, back in zip(LONG, ids_to_tokens(batch_to_ids(LONG)), strict=True):
        for token, text in zip(sentence, back, strict=True):
            assert text.encode()[:48] == token.encode()[:48] and len(text.encode()) <= 48 + 3


@pytest.mark.parametrize(
    ("where", "ids", "message"),
    [
        ((0, 1, 5), 300, r"inputs\[0\]\[1\]: id 300 is not a byte's"),
        ((1, 0, 0), 7, r"inputs\[1\]\[0\]: a token's ids begin with 259"),
        ((0, 2, 10), 7, r"inputs\[0\]\[2\]: ids other than padding \(261\) after the end of word"),
        ((0, 0, 2), 0x100, r"inputs\[0\]\[0\]: bytes b'\\xff' at byte 1 are not UTF-8"),
        ((0, 1, 6), 0, r"inputs\[0\]\[1\]: no end of word \(260\)"),
        (None, None, r"inputs\[1\]\[3\]: a token after the sentence's end \(position 2 is padding\)"),
    ],
)
def test_ids_that_no_token_has_are_refused_naming_the_position(where, ids, message):
    batch = batch_to_ids([["Hello", "world", "again", "."], ["One", "more"]])
    if where is None:  # a whole token after the end
        batch[1, 3] = batch_to_ids([["late"]])[0, 0]
    else:
        batch[where] = ids
    with pytest.raises(ConfigurationError, match=message):
        ids_to_tokens(batch)


def test_the_mix_learns_and_what_the_service_cannot_do_is_refused(server, sentences):
    elmo = Elmo(None, None, 1, dropout=0.0, url=server.url)
    assert sorted(n for n, p in elmo.named_parameters()) == [  # allennlp's names: its trained mixes load
        "scalar_mix_0.gamma",
        "scalar_mix_0.scalar_parameters.0", "scalar_mix_0.scalar_parameters.1", "scalar_mix_0.scalar_parameters.2",
        ]  # fmt: skip
    optimizer = torch.optim.SGD(elmo.parameters(), lr=0.1)
    ids = batch_to_ids(sentences[:4])
    before = elmo(ids)["elmo_representations"][0].pow(2).mean()
    for _ in range(3):
        optimizer.zero_grad()
        elmo(ids)["elmo_representations"][0].pow(2).mean().backward()
        optimizer.step()
    assert elmo(ids)["elmo_representations"][0].pow(2).mean() < before  # gradients reach the mix
    assert elmo.get_output_dim() == 32 and elmo.num_layers == 3
    for refused in ({"requires_grad": True}, {"module": torch.nn.Linear(1, 1)}):
        with pytest.raises(ConfigurationError, match="not supported by the service's Elmo"):
            Elmo(None, None, 1, url=server.url, **refused)
    with pytest.raises(FileNotFoundError, match=r"^file /nowhere/options\.json not found$"):
        Elmo("/nowhere/options.json", None, 1, url=server.url)


def test_the_bilm_is_allennlps_elmo_lstm_stateless(server, sentences, expected):
    # what allennlp code reaches for: `_elmo_lstm(ids)` (the layers with the boundaries, and their mask) and
    # `_elmo_lstm._elmo_lstm.reset_states()` (nothing to reset: the same vectors before and after)
    elmo = Elmo(None, None, 1, url=server.url)
    ids = batch_to_ids(sentences[:5])
    first = elmo._elmo_lstm(ids)
    elmo._elmo_lstm._elmo_lstm.reset_states()
    again = elmo._elmo_lstm(ids)
    assert [a.shape for a in first["activations"]] == [(5, ids.shape[1] + 2, 32)] * 3
    assert first["mask"].sum(dim=1).tolist() == [len(s) + 2 for s in sentences[:5]]
    for i, s in enumerate(sentences[:5]):
        got = np.stack([a[i, 1 : len(s) + 1].numpy() for a in first["activations"]])
        assert float(np.abs(got - expected[i]).max()) <= 1e-5
    for a, b in zip(first["activations"], again["activations"], strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


# allennlp 2.10.1's tests/modules/elmo_test.py, the TestElmo cases that need no torch biLM of ours (test_elmo,
# test_elmo_4D_input; of the others, module= is refused above and the cached vocabulary tested above), asserted
# again here on the same sentences (allennlp's file needs its data classes to run, so it is not vendored).
ALLENNLP_SENTENCES = [["The", "sentence", "."], ["ELMo", "helps", "disambiguate", "ELMo", "from", "Elmo", "."]]


def test_allennlps_test_elmo_shapes(server):
    output = Elmo(None, None, 2, dropout=0.0, url=server.url)(batch_to_ids(ALLENNLP_SENTENCES))
    assert len(output["elmo_representations"]) == 2
    assert [list(r.size()) for r in output["elmo_representations"]] == [[2, 7, 32], [2, 7, 32]]
    assert list(output["mask"].size()) == [2, 7]


def test_allennlps_test_elmo_4d_input(server):
    batches = [ALLENNLP_SENTENCES, [["1", "2"], ["1", "2", "3", "4", "5", "6", "7"]],
               [["1", "2", "3", "4", "50", "60", "70"], ["The"]]]  # fmt: skip
    elmo = Elmo(None, None, 2, dropout=0.0, url=server.url)
    ids = [batch_to_ids(b) for b in batches]
    four_d = elmo(torch.cat([i.unsqueeze(1) for i in ids], dim=1))  # (2, 3, 7, 50)
    assert list(four_d["elmo_representations"][0].size()) == [2, 3, 7, 32] and list(four_d["mask"].size()) == [2, 3, 7]
    for k, i in enumerate(ids):
        elmo._elmo_lstm._elmo_lstm.reset_states()  # as allennlp's test does: a no-op here
        np.testing.assert_array_almost_equal(
            four_d["elmo_representations"][0][:, k].detach().numpy(),
            elmo(i)["elmo_representations"][0].detach().numpy(),
        )


def test_files_given_warn_once_naming_the_server_model(server, tiny_dir, tiny_model_dir):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Elmo(str(tiny_dir / "options.json"), str(tiny_dir / "lm_weights.hdf5"), 1, url=server.url)
    assert [str(w.message) for w in caught if w.category is UserWarning] == [
        f"Elmo: options_file and weight_file are not used: the server at {server.url} computes the layers with its "
        f"model {tiny_model_dir.name!r} (3 layers of 32)"
    ]
