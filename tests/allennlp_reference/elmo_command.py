"""allennlp 0.9's `allennlp elmo` command, its glue (argparse, ElmoEmbedder's batching, embed_file) written again
against allennlp 2.10.1, which dropped the command but kept `_ElmoBiLm`, `batch_to_ids` and
`remove_sentence_boundaries`. The reference that elmo-embed's allennlp flags are compared with
(tests/service/test_allennlp_flags.py); run by /work/allennlp-venv/bin/python or build/allennlp's python
(`make allennlp`), never imported by the project's own environment.

One departure, on purpose: the biLM's LSTM state is reset before every batch. allennlp's embedder is stateful
(each batch starts from the state the previous one left), the service is stateless; with the reset, each batch
is what allennlp gives for a first batch, the vectors the service is measured against everywhere.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench.allennlp_baseline  # noqa: F401 (stubs the heavy packages allennlp imports and ELMo never uses)


def parse(argv):
    """`allennlp elmo`'s arguments, as allennlp 0.9 declares them."""
    parser = argparse.ArgumentParser(prog="allennlp elmo")
    parser.add_argument("input_file", type=argparse.FileType("r", encoding="utf-8"))
    parser.add_argument("output_file", type=str)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--all", action="store_true")
    group.add_argument("--top", action="store_true")
    group.add_argument("--average", action="store_true")
    parser.add_argument("--options-file", type=str, required=True)
    parser.add_argument("--weight-file", type=str, required=True)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--cuda-device", type=int, default=-1)
    parser.add_argument("--forget-sentences", action="store_true")
    parser.add_argument("--use-sentence-keys", action="store_true")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    import h5py
    import numpy
    import torch
    from allennlp.common.checks import ConfigurationError
    from allennlp.common.util import lazy_groups_of
    from allennlp.modules.elmo import _ElmoBiLm, batch_to_ids
    from allennlp.nn.util import remove_sentence_boundaries

    torch.set_num_threads(1)
    elmo_bilm = _ElmoBiLm(args.options_file, args.weight_file)
    if args.cuda_device >= 0:
        elmo_bilm = elmo_bilm.cuda(device=args.cuda_device)

    def embed_batch(batch):  # 0.9's ElmoEmbedder.batch_to_embeddings and embed_batch
        elmo_bilm._elmo_lstm.reset_states()  # the departure: stateless (the module's docstring)
        character_ids = batch_to_ids(batch)
        if args.cuda_device >= 0:
            character_ids = character_ids.cuda(device=args.cuda_device)
        bilm_output = elmo_bilm(character_ids)
        without = [remove_sentence_boundaries(layer, bilm_output["mask"]) for layer in bilm_output["activations"]]
        activations = torch.cat([pair[0].unsqueeze(1) for pair in without], dim=1)
        mask = without[0][1]
        out = []
        for i in range(len(batch)):
            length = int(mask[i, :].sum())
            out.append(activations[i, :, :length, :].detach().cpu().numpy())
        return out

    def embed_sentences(sentences):
        for batch in lazy_groups_of(iter(sentences), args.batch_size):
            yield from embed_batch(batch)

    output_format = "all" if args.all else "top" if args.top else "average"
    sentences = [line.strip() for line in args.input_file]  # 0.9's embed_file from here
    blank_lines = [i for (i, line) in enumerate(sentences) if line == ""]
    if blank_lines:
        raise ConfigurationError(f"Your input file contains empty lines at indexes {blank_lines}. Please remove them.")
    split_sentences = [sentence.split() for sentence in sentences]
    if args.use_sentence_keys:
        embedded = zip(sentences, embed_sentences(split_sentences), strict=True)
    else:
        embedded = ((str(i), x) for i, x in enumerate(embed_sentences(split_sentences)))
    sentence_to_index = {}
    with torch.no_grad(), h5py.File(args.output_file, "w") as fout:
        for key, embeddings in embedded:
            if args.use_sentence_keys and key in fout:
                raise ConfigurationError(
                    f"Key already exists in {args.output_file}. To encode duplicate sentences, do not pass "
                    "the --use-sentence-keys flag."
                )
            if not args.forget_sentences and not args.use_sentence_keys:
                sentence_to_index[sentences[int(key)]] = key
            if output_format == "all":
                output = embeddings
            elif output_format == "top":
                output = embeddings[-1]
            else:
                output = numpy.average(embeddings, axis=0)
            fout.create_dataset(str(key), output.shape, dtype="float32", data=output)
        if not args.forget_sentences and not args.use_sentence_keys:
            index = fout.create_dataset("sentence_to_index", (1,), dtype=h5py.special_dtype(vlen=str))
            index[0] = json.dumps(sentence_to_index)
    args.input_file.close()


if __name__ == "__main__":
    # `--each JSON`: several commands, a JSON list of argument lists, in one process (imports once: seconds each)
    if sys.argv[1:2] == ["--each"]:
        for argv in json.loads(sys.argv[2]):
            try:
                main(argv)
            except Exception as err:  # the next command still runs; the test reads what each one refused
                print(json.dumps({"argv": argv, "error": type(err).__name__, "message": str(err)}), flush=True)
    else:
        main()
