"""allennlp 2.10.1's own `Elmo` on given sentences, mix parameters and dropout seed: its representations, mask
and the gradients of a fixed loss on its mix parameters, for tests/client/test_elmo_module.py to compare the
service-backed module with. Run in the allennlp environment: `elmo_module.py SPEC.json OUT.npz`.

SPEC: options, weights, sentences, targets (an .npz: t{k}, the weights of representation k in the loss
sum_k sum(representation_k * t_k[:batch, :timesteps])), cases: [{name, do_layer_norm, dropout, seed, fixed
(scalar_mix_parameters or null), mixes: [[w_0, ..., w_L-1, gamma] per representation], and optionally
keep_sentence_boundaries, sentences (instead of SPEC's), vocab_to_cache with word_ids (batch, timesteps: the
word_inputs), state (a path: the Elmo's state_dict is saved there, torch.save)}].
"""

import importlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
importlib.import_module("bench.allennlp_baseline")  # stubs what allennlp imports and ELMo never uses


def run_case(case, spec, targets, out):
    import torch
    from allennlp.modules.elmo import Elmo, batch_to_ids

    n = len(case["mixes"])
    ids = batch_to_ids(case.get("sentences", spec["sentences"]))
    elmo = Elmo(spec["options"], spec["weights"], n, do_layer_norm=case["do_layer_norm"], dropout=case["dropout"],
                scalar_mix_parameters=case["fixed"], vocab_to_cache=case.get("vocab_to_cache"),
                keep_sentence_boundaries=case.get("keep_sentence_boundaries", False))  # fmt: skip
    mixes = [getattr(elmo, f"scalar_mix_{k}") for k in range(n)]
    with torch.no_grad():
        for mix, values in zip(mixes, case["mixes"], strict=True):
            for parameter, value in zip(mix.scalar_parameters, values[:-1], strict=True):
                parameter.fill_(value)
            mix.gamma.fill_(values[-1])
    if case.get("state"):
        torch.save(elmo.state_dict(), case["state"])
    elmo.train(case["dropout"] > 0)
    torch.manual_seed(case["seed"])
    words = torch.tensor(case["word_ids"]) if "word_ids" in case else None
    result = elmo(ids, words)  # a fresh Elmo: its first batch, stateless
    name = case["name"]
    out[f"{name}/ids"] = ids.numpy()
    out[f"{name}/mask"] = result["mask"].numpy()
    for k, r in enumerate(result["elmo_representations"]):
        out[f"{name}/rep{k}"] = r.detach().numpy()
    if case["fixed"] is None:  # fixed mix parameters: nothing to differentiate
        loss = sum(loss_of(r, targets[k]) for k, r in enumerate(result["elmo_representations"]))
        loss.backward()
        for k, mix in enumerate(mixes):
            out[f"{name}/grad{k}"] = torch.cat([p.grad for p in mix.scalar_parameters] + [mix.gamma.grad]).numpy()


def loss_of(representation, target):
    """The test's loss of one representation (batch, timesteps, dim): its sum weighted by the target's corner."""
    batch, timesteps = representation.shape[:2]
    return (representation * target[:batch, :timesteps]).sum()


def main():
    import numpy
    import torch

    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    data = numpy.load(spec["targets"])
    targets = [torch.from_numpy(data[f"t{k}"]) for k in range(len(data.files))]
    out = {}
    for case in spec["cases"]:
        run_case(case, spec, targets, out)
    numpy.savez(sys.argv[2], **out)


if __name__ == "__main__":
    main()
