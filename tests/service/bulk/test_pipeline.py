"""elmo-embed: files in, allennlp-style hdf5 out, equal to the reference; bad lines named."""

import json
import subprocess
import sys
import threading

import h5py
import numpy as np
import pytest

import service.bulk.pipeline
from service.bulk import InputError, Shard, embed_file, plan_batches, read_embeddings, read_sentences
from tests.conftest import max_error


def embed_cli(model_dir, *args):
    return subprocess.run(
        [sys.executable, "-m", "service.cli", "--model", str(model_dir), *map(str, args)],
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_round_trip_equals_reference(tiny_model_dir, sentences, expected, tmp_path, suffix):
    source = tmp_path / f"in{suffix}"
    lines = [" ".join(s) if suffix == ".txt" else json.dumps(s) for s in sentences]
    source.write_text("\n".join(lines) + "\n")
    run = embed_cli(tiny_model_dir, source, tmp_path / "out.hdf5", "--batch-tokens", 200)
    assert run.returncode == 0, run.stderr
    assert "embedded 30 sentences" in run.stderr and "elmo-embed" in run.stderr  # progress on stderr
    got, index = read_embeddings(tmp_path / "out.hdf5")
    assert list(got) == list(range(30))
    assert max_error(list(got.values()), expected) <= 1e-5
    assert index[" ".join(sentences[7])] == "7"
    with h5py.File(tmp_path / "out.hdf5", "r") as f:
        assert f["0"].dtype == np.float32 and len(f) == 31


def test_many_chunks_and_batches_keep_line_order(engine, sentences, expected, tmp_path, monkeypatch):
    monkeypatch.setattr("service.bulk.pipeline.CHUNK_BATCHES", 1)  # a chunk per ~100 tokens: streamed in pieces
    source = tmp_path / "in.txt"
    source.write_text("\n".join(" ".join(s) for s in sentences * 3) + "\n")
    stats = embed_file(engine, source, tmp_path / "out.hdf5", batch_tokens=100, progress=False)
    assert stats["sentences"] == 90 and stats["tokens"] == 3 * sum(map(len, sentences))
    got, _ = read_embeddings(tmp_path / "out.hdf5")
    assert list(got) == list(range(90))
    assert max_error(list(got.values()), expected * 3) <= 1e-5


def test_pipelined_output_equals_each_sentence_run_alone(engine, sentences, tmp_path, monkeypatch):
    monkeypatch.setattr("service.bulk.pipeline.CHUNK_BATCHES", 1)  # many chunks: the reader, engine and writer overlap
    source = tmp_path / "in.txt"
    lines = sentences * 4
    source.write_text("\n".join(" ".join(s) for s in lines) + "\n")
    embed_file(engine, source, tmp_path / "out.hdf5", batch_tokens=100, progress=False)
    got, index = read_embeddings(tmp_path / "out.hdf5")
    assert list(got) == list(range(len(lines)))
    for line, layers in got.items():
        np.testing.assert_array_equal(layers, engine.run([lines[line]])[0])  # the same bits as unbatched
    assert index == {" ".join(s): str(90 + i) for i, s in enumerate(sentences)}  # a repeated sentence: its last line


class SlowEngine:
    """The engine, whose runs set `busy`, can be made to wait for an event, and fail at a given call."""

    def __init__(self, engine, wait_for=None, fail_at=None, error=None):
        self.engine, self.wait_for, self.fail_at, self.error, self.calls = engine, wait_for, fail_at, error, 0
        self.window = engine.window  # the Loop graph's: batches, run whole
        self.busy = threading.Event()

    def run(self, batch):
        self.calls += 1
        self.busy.set()
        if self.wait_for is not None:
            assert self.wait_for.wait(30)
        if self.calls == self.fail_at:
            raise self.error
        return self.engine.run(batch)


def counting_reader(monkeypatch, hold=(None, None)):
    """Patch elmo-embed's reader to count the lines it yields, to set `failed` when it raises, and, with
    hold=(line index, event), to wait for the event before it reads that line."""
    read, failed = [], threading.Event()

    def reader(*args, **kwargs):
        try:
            for line in read_sentences(*args, **kwargs):
                if line[0] == hold[0]:
                    assert hold[1].wait(30)
                read.append(line[0])
                yield line
        except InputError:
            failed.set()
            raise

    monkeypatch.setattr(service.bulk.pipeline, "read_sentences", reader)
    return read, failed


def test_a_bad_line_read_while_the_engine_runs_is_named(engine, sentences, tmp_path, monkeypatch):
    # Two chunks: the engine's first batch (of the first chunk) runs until the reader has met the bad line at
    # the end of the second one, and the reader reads the second chunk's end only once the engine has started.
    tokens = 40 * sum(map(len, sentences))
    monkeypatch.setattr("service.bulk.pipeline.CHUNK_BATCHES", tokens // 2 // 100 + 1)
    source = tmp_path / "in.txt"
    source.write_text("".join(" ".join(s) + "\n" for s in sentences * 40) + "\n")  # line 1201 is empty
    threads = threading.active_count()
    slow = SlowEngine(engine)
    _, slow.wait_for = counting_reader(monkeypatch, hold=(1199, slow.busy))
    with pytest.raises(InputError, match=r"in.txt:1201: empty sentence"):
        embed_file(slow, source, tmp_path / "out.hdf5", batch_tokens=100, progress=False)
    assert slow.calls == 1  # stopped at once, not after embedding the lines before the bad one
    assert not list(tmp_path.glob("out.hdf5*"))
    assert threading.active_count() == threads


@pytest.mark.parametrize("error", [RuntimeError("the engine failed"), KeyboardInterrupt()])
def test_an_engine_failure_stops_every_thread_and_leaves_no_file(engine, sentences, tmp_path, monkeypatch, error):
    monkeypatch.setattr("service.bulk.pipeline.CHUNK_BATCHES", 1)
    read, _ = counting_reader(monkeypatch)
    source = tmp_path / "in.txt"
    source.write_text("".join(" ".join(s) + "\n" for s in sentences * 40))
    threads = threading.active_count()
    with pytest.raises(type(error)):
        embed_file(SlowEngine(engine, fail_at=3, error=error), source, tmp_path / "out.hdf5", 100, progress=False)
    assert not list(tmp_path.glob("out.hdf5*"))
    assert threading.active_count() == threads
    assert len(read) < 1200 / 4  # the reader stopped a few chunks ahead, not at the end of the file


def test_a_write_failure_stops_the_run(engine, sentences, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("".join(" ".join(s) + "\n" for s in sentences))
    threads = threading.active_count()
    with pytest.raises(OSError):
        embed_file(engine, source, tmp_path / "no such folder" / "out.hdf5", progress=False)
    assert threading.active_count() == threads


@pytest.mark.parametrize("count", [1, 3, 7, 40])
def test_shards_cover_every_line_once_with_the_unsharded_vectors(engine, sentences, tmp_path, monkeypatch, count):
    monkeypatch.setattr("service.bulk.pipeline.CHUNK_BATCHES", 1)  # several chunks per shard
    source = tmp_path / "in.txt"
    lines = sentences + sentences[:5]  # 35 lines, a repeated sentence maps to its last line
    source.write_text("\n".join(" ".join(s) for s in lines) + "\n")
    embed_file(engine, source, tmp_path / "all.hdf5", batch_tokens=100, progress=False)
    whole, whole_index = read_embeddings(tmp_path / "all.hdf5")

    merged, merged_index = {}, {}
    for i in range(count):
        out = tmp_path / f"part{i}.hdf5"
        stats = embed_file(engine, source, out, batch_tokens=100, progress=False, shard=Shard(i, count))
        part, part_index = read_embeddings(out)
        assert list(part) == [k for k in range(len(lines)) if k % count == i]  # keys are the original line indexes
        assert stats["sentences"] == len(part)
        assert not merged.keys() & part.keys()
        merged |= part
        for text, line in part_index.items():  # a repeated sentence: the unsharded file keeps its last line
            merged_index[text] = max(merged_index.get(text, line), line, key=int)
    assert sorted(merged) == list(range(len(lines)))
    assert merged_index == whole_index
    for line, layers in whole.items():
        np.testing.assert_array_equal(merged[line], layers)  # batched with other sentences: the same bits


def test_shard_on_the_command_line(tiny_model_dir, sentences, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("\n".join(" ".join(s) for s in sentences) + "\n")
    run = embed_cli(tiny_model_dir, source, tmp_path / "out.hdf5", "--shard", "2/4", "--no-progress")
    assert run.returncode == 0, run.stderr
    assert "embedded 7 sentences of shard 2/4" in run.stderr
    got, index = read_embeddings(tmp_path / "out.hdf5")
    assert list(got) == [2, 6, 10, 14, 18, 22, 26]
    assert index[" ".join(sentences[6])] == "6"


def test_a_bad_line_stops_only_its_shard(engine, tmp_path):
    (tmp_path / "in.txt").write_text("one\ntwo\n\nfour\n")  # line 3 (index 2) is empty
    embed_file(engine, tmp_path / "in.txt", tmp_path / "odd.hdf5", progress=False, shard=Shard(1, 2))
    with pytest.raises(InputError, match=r"in.txt:3: empty sentence"):
        embed_file(engine, tmp_path / "in.txt", tmp_path / "even.hdf5", progress=False, shard=Shard(0, 2))


@pytest.mark.parametrize("value", ["2/2", "4/2", "0/0", "-1/2", "a/b", "1", "1/2/3", "", "1/"])
def test_bad_shard_is_named(tiny_model_dir, tmp_path, value):
    (tmp_path / "in.txt").write_text("a line\n")
    run = embed_cli(tiny_model_dir, tmp_path / "in.txt", tmp_path / "out.hdf5", f"--shard={value}")
    assert run.returncode == 2
    assert "argument --shard" in run.stderr and "0 <= i < n" in run.stderr and "Traceback" not in run.stderr
    assert not list(tmp_path.glob("out.hdf5*"))


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.jsonl", '["ok"]\n["fine", "too"]\n{"not": "a list"}\n', "bad.jsonl:3: expected a JSON list"),
        ("bad.jsonl", '["ok"]\n[1, 2]\n', "bad.jsonl:2: expected a JSON list"),
        ("bad.jsonl", '["ok"]\n["unclosed"\n', "bad.jsonl:2: not JSON"),
        ("bad.txt", "fine line\n\nafter empty\n", "bad.txt:2: empty sentence"),
    ],
)
def test_bad_line_stops_with_its_number(tiny_model_dir, tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    run = embed_cli(tiny_model_dir, tmp_path / name, tmp_path / "out.hdf5", "--no-progress")
    assert run.returncode == 1
    assert message in run.stderr and "Traceback" not in run.stderr
    assert not list(tmp_path.glob("out.hdf5*"))  # no half-written output left behind


def test_invalid_utf8_is_named(engine, tmp_path):
    (tmp_path / "bin.txt").write_bytes(b"good line\nbad \xff byte\n")
    with pytest.raises(InputError, match=r"bin.txt:2: not UTF-8"):
        embed_file(engine, tmp_path / "bin.txt", tmp_path / "out.hdf5", progress=False)


def test_batches_respect_the_padded_token_budget():
    lengths = [5, 30, 2, 30, 7, 100, 1]
    batches = plan_batches(lengths, batch_tokens=64)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        padded = len(batch) * (max(lengths[i] for i in batch) + 2)
        assert padded <= 64 or len(batch) == 1
        assert [lengths[i] for i in batch] == sorted((lengths[i] for i in batch), reverse=True)


def test_fp16_on_the_command_line_is_close_to_fp32(tiny_model_dir, sentences, expected, tmp_path):
    # --precision fp16 runs the reduced-precision window graph (here on the CPU's fp16 products)
    source = tmp_path / "in.txt"
    source.write_text("\n".join(" ".join(s) for s in sentences) + "\n")
    run = embed_cli(tiny_model_dir, source, tmp_path / "out.hdf5", "--precision", "fp16", "--no-progress")
    assert run.returncode == 0, run.stderr
    got, _ = read_embeddings(tmp_path / "out.hdf5")
    error = max(float(np.abs(got[i] - want).max()) for i, want in enumerate(expected))
    assert 0 < error <= 1e-2  # not the fp32 graph's numbers, and near them


def test_on_the_window_graph_lines_stream_through_packed_rows_across_chunks(
    tiny_model_dir, engine, sentences, tmp_path, monkeypatch
):
    """elmo-embed on the window graph (a GPU's) runs the lines as the service does: rows packed and refilled
    across chunks, the writer putting each sentence together. The same numbers as the Loop graph's file, every
    line once, repeated sentences indexed by their last line."""
    from service.engine.session import Engine

    monkeypatch.setattr("service.bulk.pipeline.CHUNK_BATCHES", 1)  # many chunks: sentences of several in flight at once
    lines = sentences * 7
    source = tmp_path / "in.txt"
    source.write_text("".join(" ".join(s) + "\n" for s in lines))
    window = Engine(tiny_model_dir, provider="cpu", graph="window", max_rows=16)
    stats = embed_file(window, source, tmp_path / "window.hdf5", batch_tokens=200, progress=False)
    embed_file(engine, source, tmp_path / "loop.hdf5", batch_tokens=200, progress=False)
    got, got_index = read_embeddings(tmp_path / "window.hdf5")
    want, want_index = read_embeddings(tmp_path / "loop.hdf5")
    assert stats["sentences"] == len(lines) and sorted(got) == list(range(len(lines)))
    assert got_index == want_index and got_index[" ".join(sentences[0])] == str(len(lines) - len(sentences))
    assert max(float(np.abs(got[k] - want[k]).max()) for k in want) <= 1e-6


def test_float16_output_halves_the_file_and_rounds_each_number_once(tiny_model_dir, engine, sentences, tmp_path):
    # --dtype float16: the same vectors rounded once to float16 (both graphs), half the bytes of the float32 file
    from service.engine.session import Engine

    source = tmp_path / "in.txt"
    source.write_text("".join(" ".join(s) + "\n" for s in sentences * 4))
    run = embed_cli(tiny_model_dir, source, tmp_path / "half.hdf5", "--dtype", "float16", "--no-progress")
    assert run.returncode == 0, run.stderr
    embed_file(engine, source, tmp_path / "full.hdf5", batch_tokens=200, progress=False)
    window = Engine(tiny_model_dir, provider="cpu", graph="window", max_rows=16)
    embed_file(window, source, tmp_path / "window.hdf5", batch_tokens=200, progress=False, dtype="float16")
    half, _ = read_embeddings(tmp_path / "half.hdf5")
    full, _ = read_embeddings(tmp_path / "full.hdf5")
    packed, _ = read_embeddings(tmp_path / "window.hdf5")
    for k, want in full.items():
        assert half[k].dtype == np.float16 and packed[k].dtype == np.float16
        np.testing.assert_array_equal(half[k], want.astype(np.float16))  # rounded once, from the float32 numbers
        assert float(np.abs(packed[k].astype(np.float32) - want).max()) <= 1e-5 + float(np.abs(want).max()) / 1024
    data = sum(x.nbytes for x in full.values())
    assert sum(x.nbytes for x in half.values()) == data // 2
    sizes = [(tmp_path / name).stat().st_size for name in ("full.hdf5", "half.hdf5")]
    assert sizes[1] < 0.6 * sizes[0]
