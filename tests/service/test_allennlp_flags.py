"""elmo-embed with allennlp 0.9's `elmo` flags against `allennlp elmo` itself (its command's glue on allennlp
2.10.1's biLM, tests/allennlp_reference/elmo_command.py, stateless as the service) on the same input: every name,
group, shape and dtype identical, every dataset within 1e-5, sentence_to_index equal; and the same refusals."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from service.cli import BATCH_SIZE_TOKENS, _embed_args, _embed_parser, embed_main
from tests.allennlp_reference import run_allennlp

# Each flag, and the combinations whose outputs differ in kind: (name, flags).
VARIANTS = [
    ("all", ["--all"]),
    ("top", ["--top"]),
    ("average", ["--average"]),
    ("sentence-keys", ["--all", "--use-sentence-keys"]),
    ("sentence-keys-average", ["--average", "--use-sentence-keys"]),
    ("top-forget-sentences", ["--top", "--forget-sentences"]),
    ("batch-size-cpu", ["--all", "--batch-size", "4", "--cuda-device", "-1"]),
]
# Lines that a file from the wild has: spaces around and between tokens, tabs, a "/" (a group under
# --use-sentence-keys), letters beyond ASCII, a single token.
AWKWARD = ["  spaces around   and  between  ", "tabs\tbetween\ttokens .", "test / this is a first sentence",
           "naïve café Zürich — ünïcode .", "Alone"]  # fmt: skip


@pytest.fixture(scope="module")
def compared(tiny_dir, sentences, tmp_path_factory):
    """{variant: (allennlp's file, elmo-embed's file)}, and the refusals of a file with empty lines."""
    work = tmp_path_factory.mktemp("allennlp-flags")
    source = work / "in.txt"
    source.write_text("".join(" ".join(s) + "\n" for s in sentences) + "".join(line + "\n" for line in AWKWARD))
    empty = work / "empty.txt"
    empty.write_text("A\n\n \nB\n")  # 0.9's own test's file: indexes 1 and 2 are empty once stripped
    files = ["--options-file", str(tiny_dir / "options.json"), "--weight-file", str(tiny_dir / "lm_weights.hdf5")]
    commands = [[str(source), str(work / f"allennlp-{name}.hdf5"), *flags, *files] for name, flags in VARIANTS]
    commands.append([str(empty), str(work / "allennlp-empty.hdf5"), "--all", *files])
    done = run_allennlp("elmo_command.py", "--each", json.dumps(commands))
    assert done.returncode == 0, done.stderr[-3000:]
    refusals = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    outputs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ELMO_CACHE_DIR", str(work / "cache"))
        for name, flags in VARIANTS:
            out = work / f"elmo-embed-{name}.hdf5"
            assert embed_main([str(source), str(out), *flags, *files, "--threads", "1", "--no-progress"]) == 0
            outputs[name] = (work / f"allennlp-{name}.hdf5", out)
        refused = embed_main([str(empty), str(work / "elmo-embed-empty.hdf5"), *files, "--no-progress"])
    return outputs, refusals, refused, work


def contents(path) -> dict[str, object]:
    """Every object of an hdf5 file by its full name: "group" for a group, the array for a dataset."""
    found = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: found.update({name: "group" if isinstance(obj, h5py.Group) else obj[()]}))
    return found


@pytest.mark.parametrize("variant", [name for name, _ in VARIANTS])
def test_every_dataset_equals_allennlp_elmo(compared, variant, capsys):
    allennlp_file, ours_file = compared[0][variant]
    theirs, ours = contents(allennlp_file), contents(ours_file)
    assert sorted(ours) == sorted(theirs)  # names, groups included ("test " for the "/" line's sentence key)
    index = theirs.pop("sentence_to_index", None)
    if index is not None:
        assert json.loads(ours.pop("sentence_to_index")[0]) == json.loads(index[0])
    assert ("sentence_to_index" in ours) is False
    worst = 0.0
    for name, want in theirs.items():
        got = ours[name]
        if isinstance(want, str):
            assert got == "group"
            continue
        assert got.shape == want.shape and got.dtype == want.dtype == np.float32, name
        worst = max(worst, float(np.abs(got - want).max()))
    assert worst <= 1e-5
    datasets = sum(not isinstance(x, str) for x in theirs.values())
    with capsys.disabled():
        print(f"\n{variant}: {datasets} datasets, max abs error {worst:.3g}")


def test_shapes_follow_the_flag(compared, sentences):
    n = len(sentences[0])
    for variant, shape in (("all", (3, n, 32)), ("top", (n, 32)), ("average", (n, 32))):
        assert contents(compared[0][variant][1])["0"].shape == shape
    keyed = contents(compared[0]["sentence-keys"][1])
    assert keyed[" ".join(sentences[0])].shape == (3, n, 32) and keyed["test "] == "group"
    assert keyed["test / this is a first sentence"].shape == (3, 7, 32)


def test_an_empty_line_is_refused_as_allennlp_refuses_it(compared, capsys):
    _, refusals, refused, work = compared
    # allennlp 0.9 (and this port) refuses the whole file, naming the empty lines; so does elmo-embed
    (allennlp,) = refusals
    assert allennlp["error"] == "ConfigurationError" and "empty lines at indexes [1, 2]" in allennlp["message"]
    assert refused == 1 and not (work / "elmo-embed-empty.hdf5").exists()


def test_the_model_files_are_exported_once(compared, capsys):
    work = compared[3]
    exports = [p for p in (work / "cache").iterdir() if p.is_dir()]  # beside each, its lock (service/export_cache.py)
    assert len(exports) == 1  # seven runs, one export
    assert (exports[0] / "manifest.json").is_file()
    assert sorted(p.name for p in (work / "cache").iterdir()) == [exports[0].name, f"{exports[0].name}.lock"]


def test_a_repeated_sentence_under_sentence_keys_is_refused(tiny_dir, tmp_path, capsys):
    source = tmp_path / "in.txt"
    source.write_text("the same line\nanother\n  the same line\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ELMO_CACHE_DIR", str(tmp_path / "cache"))
        code = embed_main([str(source), str(tmp_path / "out.hdf5"), "--use-sentence-keys", "--no-progress",
                           "--options-file", str(tiny_dir / "options.json"),
                           "--weight-file", str(tiny_dir / "lm_weights.hdf5")])  # fmt: skip
    assert code == 1 and "line 2: key already exists" in capsys.readouterr().err
    assert not list(tmp_path.glob("out.hdf5*"))


def test_allennlp_device_and_batch_flags_map_to_the_engine():
    parser = _embed_parser()
    args = _embed_args(parser, ["in.txt", "out.hdf5", "--cuda-device", "1", "--batch-size", "32", "--top"])
    assert (args.provider, args.device_id, args.batch_tokens) == ("cuda", 1, 32 * BATCH_SIZE_TOKENS)
    assert args.output_kind.layers == "top"
    args = _embed_args(parser, ["in.txt", "out.hdf5", "--cuda-device", "-1"])
    assert (args.provider, args.output_kind.layers) == ("cpu", "all")
    for bad in (["--batch-size", "2", "--batch-tokens", "9"], ["--options-file", "o.json"], ["--top", "--all"]):
        with pytest.raises(SystemExit) as exit_:
            _embed_args(parser, ["in.txt", "out.hdf5", *bad])
        assert exit_.value.code == 2


def test_files_that_cannot_be_exported_are_named(tmp_path, capsys):
    url = "https://allennlp.s3.amazonaws.com/models/elmo/options.json"
    for options, message in ((url, "reads local files only"), (str(tmp_path / "none.json"), "not found")):
        (tmp_path / "in.txt").write_text("a line\n")
        code = embed_main([str(tmp_path / "in.txt"), str(tmp_path / "out.hdf5"), "--options-file", options,
                           "--weight-file", str(tmp_path / "w.hdf5")])  # fmt: skip
        assert code == 1 and message in capsys.readouterr().err
