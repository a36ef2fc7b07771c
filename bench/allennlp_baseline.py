"""allennlp 2.10.1 ELMo baseline -- for benchmarks and reference outputs only.

Embeds every line of a whitespace-tokenized text file the way allennlp 0.9's
`allennlp elmo --all` did (its ElmoEmbedder.embed_file/embed_batch, ported here
because allennlp 2.x dropped that command: glue code only) on top of allennlp 2.10.1's
`_ElmoBiLm`, and prints one JSON line of timings.  Not a test dependency.

Run it with /work/allennlp-venv/bin/python; create that venv with (in order):

    python3 -m venv /work/allennlp-venv
    /work/allennlp-venv/bin/pip install torch==2.13.0
    /work/allennlp-venv/bin/pip install --no-deps allennlp==2.10.1 "cached-path>=1.1.3,<1.2.0"
    /work/allennlp-venv/bin/pip install numpy h5py requests "rich>=12.1,<13.0" dill base58 \
        "termcolor==1.1.0" more-itertools tqdm lmdb

`--device cuda` runs `_ElmoBiLm` and the char ids on the GPU (fp32, TF32 off, as the project's engine);
`--warmup N` embeds the first batch N times untimed first. On a GPU machine, install allennlp with --no-deps
beside a CUDA torch (e.g. `pip install --target DIR`, then PYTHONPATH=DIR) rather than the CPU torch above.
bench/gpu.py runs this script with `--allennlp PYTHON`.

Heavy packages that allennlp imports but ELMo never uses (transformers, spacy,
nltk, torchvision, fairscale, boto3, google-cloud, huggingface_hub, ...) are
replaced by inert stub modules below, so nothing downloads or loads them.
"""

import time

_T_SCRIPT = time.time()

import argparse
import importlib.abc
import importlib.machinery
import json
import os
import sys
import types

_STUBBED = (
    "transformers",
    "spacy",
    "nltk",
    "torchvision",
    "wandb",
    "fairscale",
    "tensorboardX",
    "sklearn",
    "scipy",
    "checklist",
    "matplotlib",
    "sacremoses",
    "sentencepiece",
    "huggingface_hub",
    "boto3",
    "botocore",
    "google",
)


class _DummyMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _dummy(name)

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    __ror__ = __or__


def _dummy(name):
    return _DummyMeta(
        name,
        (),
        {
            "__init__": lambda self, *a, **k: None,
            "__call__": lambda self, *a, **k: a[0] if a and callable(a[0]) else self,
        },
    )


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _dummy(name)
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in _STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _StubFinder())


def _process_start_time():
    """Wall-clock start of this process (from /proc), else the script start."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return btime + start_ticks / os.sysconf("SC_CLK_TCK")
    except Exception:
        return _T_SCRIPT


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--options", required=True)
    parser.add_argument("--weights", required=True)
    parser.add_argument("--input", required=True)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output")
    parser.add_argument(
        "--stateless", action="store_true", help="reset the biLM LSTM states to zero before every batch"
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: where _ElmoBiLm and the char ids go")
    parser.add_argument(
        "--warmup", type=int, default=0, help="embed the first batch this many times, untimed, before the timed run"
    )
    return parser


def _device(args):
    import torch

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        # fp32 means fp32, as the project's engine on CUDA (cuDNN's convolutions default to TF32 on Ampere+)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return device


def _embedder(elmo_bilm, device):
    """What allennlp 0.9's `elmo --all` command did per batch, written against the 2.10.1 API: a batch of
    sentences to each one's (layers, tokens, dim) array."""
    import torch
    from allennlp.modules.elmo import batch_to_ids
    from allennlp.nn.util import remove_sentence_boundaries

    def batch_to_embeddings(batch):
        character_ids = batch_to_ids(batch).to(device)
        bilm_output = elmo_bilm(character_ids)
        layer_activations = bilm_output["activations"]
        mask_with_bos_eos = bilm_output["mask"]
        without_bos_eos = [remove_sentence_boundaries(layer, mask_with_bos_eos) for layer in layer_activations]
        activations = torch.cat([ele[0].unsqueeze(1) for ele in without_bos_eos], dim=1)
        mask = without_bos_eos[0][1]
        return activations, mask

    def embed_batch(batch):
        embeddings, mask = batch_to_embeddings(batch)
        out = []
        for i in range(len(batch)):
            length = int(mask[i, :].sum())
            out.append(embeddings[i, :, :length, :].detach().cpu().numpy())
        return out

    return embed_batch


def _read_sentences(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        sentences = [line.strip() for line in f]
    blank_lines = [i for (i, line) in enumerate(sentences) if line == ""]
    if blank_lines:
        raise SystemExit(f"input contains empty lines at indexes {blank_lines}; remove them")
    return sentences


def _embed_all(args, elmo_bilm, embed_batch, split_sentences) -> tuple[list, float]:
    """Every sentence's embeddings, and the seconds the timed batches took (the warm-up's not counted)."""
    import torch
    from allennlp.common.util import lazy_groups_of

    embed_s = 0.0
    results = []
    with torch.no_grad():
        for _ in range(args.warmup):  # CUDA's context, cuDNN's algorithm choice, the allocator's pool
            embed_batch(split_sentences[: args.batch_size])
        for batch in lazy_groups_of(split_sentences, args.batch_size):
            t0 = time.perf_counter()
            if args.stateless:
                elmo_bilm._elmo_lstm.reset_states()
            results.extend(embed_batch(batch))
            embed_s += time.perf_counter() - t0
    return results, embed_s


def _write_hdf5(path: str, sentences: list[str], results: list) -> float:
    """The embeddings in allennlp's `elmo` command's hdf5 layout; the seconds it took."""
    import h5py

    t0 = time.perf_counter()
    sentence_to_index = {}
    with h5py.File(path, "w") as fout:
        for i, embeddings in enumerate(results):
            key = str(i)
            sentence_to_index[sentences[i]] = key
            fout.create_dataset(key, embeddings.shape, dtype="float32", data=embeddings)
        ds = fout.create_dataset("sentence_to_index", (1,), dtype=h5py.special_dtype(vlen=str))
        ds[0] = json.dumps(sentence_to_index)
    return time.perf_counter() - t0


def main():
    args = _parser().parse_args()
    device = _device(args)
    import torch
    from allennlp.modules.elmo import _ElmoBiLm

    t0 = time.perf_counter()
    elmo_bilm = _ElmoBiLm(args.options, args.weights)
    elmo_bilm.eval()
    elmo_bilm.to(device)
    load_s = time.perf_counter() - t0

    sentences = _read_sentences(args.input)
    split_sentences = [sentence.split() for sentence in sentences]
    n_tokens = sum(len(s) for s in split_sentences)
    results, embed_s = _embed_all(args, elmo_bilm, _embedder(elmo_bilm, device), split_sentences)
    write_s = _write_hdf5(args.output, sentences, results) if args.output else None

    report = {
        "impl": "allennlp-2.10.1",
        "sentences": len(split_sentences),
        "tokens": n_tokens,
        "batch_size": args.batch_size,
        "threads": args.threads,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "warmup": args.warmup,
        "stateless": args.stateless,
        "load_s": round(load_s, 4),
        "embed_s": round(embed_s, 4),
        "tokens_per_s": round(n_tokens / embed_s, 2) if embed_s > 0 else None,
        "write_s": None if write_s is None else round(write_s, 4),
        "process_s": round(time.time() - _process_start_time(), 3),
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
