"""allennlp 2.10.1's own `Elmo` on given sentences, mix parameters and dropout seed: its representations, mask
and the gradients of a fixed loss on its mix parameters, for tests/client/test_elmo_module.py to compare the
service-backed module with. Run in the allennlp environment: `elmo_module.py SPEC.json OUT.npz`.

SPEC: options, weights, sentences, targets (an .npz: t{k}, the weights of representation k in the loss
sum_k sum(representation_k * t_k)), cases: [{name, do_layer_norm, dropout, seed, fixed (scalar_mix_parameters
or null), mixes: [[w_0, ..., w_L-1, gamma] per representation]}].

Each case also writes "<name>/tokens_rep{k}": allennlp's ScalarMix (its class, the same parameters) applied to
the biLM's layers with the boundary tokens removed first, then masked and dropped out as Elmo does: allennlp's
mix semantics on the layers the service returns. With do_layer_norm, allennlp's Elmo normalises over the
boundary tokens too; the tests measure that difference and compare the service-backed module with this one.
"""

import importlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
importlib.import_module("bench.allennlp_baseline")  # stubs what allennlp imports and ELMo never uses


def run_case(case, spec, ids, targets, out):
    import torch
    from allennlp.modules.elmo import Elmo
    from allennlp.modules.scalar_mix import ScalarMix
    from allennlp.nn.util import remove_sentence_boundaries

    n = len(case["mixes"])
    elmo = Elmo(spec["options"], spec["weights"], n, do_layer_norm=case["do_layer_norm"], dropout=case["dropout"],
                scalar_mix_parameters=case["fixed"])  # fmt: skip
    mixes = [getattr(elmo, f"scalar_mix_{k}") for k in range(n)]
    with torch.no_grad():
        for mix, values in zip(mixes, case["mixes"], strict=True):
            for parameter, value in zip(mix.scalar_parameters, values[:-1], strict=True):
                parameter.fill_(value)
            mix.gamma.fill_(values[-1])
    elmo.train(case["dropout"] > 0)
    torch.manual_seed(case["seed"])
    result = elmo(ids)  # a fresh Elmo: its first batch, stateless
    loss = sum((r * targets[k]).sum() for k, r in enumerate(result["elmo_representations"]))
    if case["fixed"] is None:  # fixed mix parameters: nothing to differentiate
        loss.backward()
    name = case["name"]
    out[f"{name}/mask"] = result["mask"].numpy()
    for k, (r, mix) in enumerate(zip(result["elmo_representations"], mixes, strict=True)):
        out[f"{name}/rep{k}"] = r.detach().numpy()
        if case["fixed"] is None:
            out[f"{name}/grad{k}"] = torch.cat([p.grad for p in mix.scalar_parameters] + [mix.gamma.grad]).numpy()
    # allennlp's ScalarMix on the boundary-free layers (the module docstring)
    elmo._elmo_lstm._elmo_lstm.reset_states()
    bilm = elmo._elmo_lstm(ids)
    pairs = [remove_sentence_boundaries(layer, bilm["mask"]) for layer in bilm["activations"]]
    layers, mask = [p[0].detach() for p in pairs], pairs[0][1]
    torch.manual_seed(case["seed"])
    for k, values in enumerate(case["mixes"]):
        mix = ScalarMix(len(layers), case["do_layer_norm"], values[:-1], trainable=case["fixed"] is None)
        with torch.no_grad():
            mix.gamma.fill_(values[-1])
        r = elmo._dropout(mix(layers, mask) * mask.unsqueeze(-1))
        out[f"{name}/tokens_rep{k}"] = r.detach().numpy()
        if case["fixed"] is None:
            grads = torch.autograd.grad((r * targets[k]).sum(), [*mix.scalar_parameters, mix.gamma])
            out[f"{name}/tokens_grad{k}"] = torch.cat(grads).numpy()


def main():
    import numpy
    import torch
    from allennlp.modules.elmo import batch_to_ids

    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    ids = batch_to_ids(spec["sentences"])
    data = numpy.load(spec["targets"])
    targets = [torch.from_numpy(data[f"t{k}"]) for k in range(len(data.files))]
    out = {"ids": ids.numpy()}
    for case in spec["cases"]:
        run_case(case, spec, ids, targets, out)
    numpy.savez(sys.argv[2], **out)


if __name__ == "__main__":
    main()
