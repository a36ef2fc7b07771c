"""Validate custom resources strictly against their CustomResourceDefinition's schema (`make lint`).

    python scripts/validate_crd.py --crd CRD.json [--crd ...] [--rest NATIVE.yaml] RENDERED.yaml

Every document of RENDERED.yaml whose apiVersion and kind a CRD names is checked against that version's
openAPIV3Schema, with unknown fields refused: what `kubectl apply --validate=strict` asks of the API server, which
otherwise drops them without a word (a misspelt `shutdownAfterJobFinishes` would leave the cluster running).
The other documents go to --rest, for kubernetes-validate, which knows the built-in kinds only: it passes a kind it
has no schema for with a warning, so a custom resource must not reach it. Exit status 1 on any error, each named by
its document and path; 2 when no document of a CRD's kind was found (a renamed kind must not pass unchecked).

The schema is Kubernetes' structural OpenAPI v3, not quite JSON Schema: `nullable`, `x-kubernetes-int-or-string`
are turned into JSON Schema here; `x-kubernetes-validations` (CEL rules) are not evaluated."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml
from jsonschema import Draft7Validator

# The object's own metadata: the CRD's schema says only `type: object` (the API server checks it as ObjectMeta);
# the fields a manifest may set.
OBJECT_META = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string"},
        "generateName": {"type": "string"},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        "finalizers": {"type": "array", "items": {"type": "string"}},
        "ownerReferences": {"type": "array", "items": {"type": "object"}},
    },
}


def strict(schema: dict) -> dict:
    """The structural schema as JSON Schema, an object with `properties` closed to any other field."""
    out = {key: value for key, value in schema.items() if not key.startswith("x-kubernetes-") and key != "nullable"}
    for key in ("properties", "patternProperties"):
        if key in out:
            out[key] = {name: strict(sub) for name, sub in out[key].items()}
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = strict(out[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = [strict(sub) for sub in out[key]]
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False  # no x-kubernetes-preserve-unknown-fields: a field not named is refused
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def validators(crd_paths: list[Path]) -> dict[tuple[str, str], Draft7Validator]:
    """(apiVersion, kind) -> the validator of that served version."""
    found = {}
    for path in crd_paths:
        crd = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if not version.get("served", True):
                continue
            schema = strict(version["schema"]["openAPIV3Schema"])
            schema["properties"]["metadata"] = OBJECT_META
            schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
            found[(f"{group}/{version['name']}", kind)] = Draft7Validator(schema)
    return found


def where(error) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path) or "."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--crd", type=Path, action="append", required=True, help="a CRD (JSON or YAML)")
    parser.add_argument("--rest", type=Path, help="write the documents no CRD names here (for kubernetes-validate)")
    parser.add_argument("rendered", type=Path, help="the rendered manifests (kustomize build's output)")
    args = parser.parse_args(argv)
    known = validators(args.crd)
    documents = [doc for doc in yaml.safe_load_all(args.rendered.read_text()) if doc]
    rest, seen, errors = [], set(), []
    for doc in documents:
        key = (doc.get("apiVersion"), doc.get("kind"))
        if key not in known:
            rest.append(doc)
            continue
        seen.add(key)
        name = f"{key[1]} {doc.get('metadata', {}).get('name', '?')}"
        for error in sorted(known[key].iter_errors(doc), key=lambda e: list(map(str, e.absolute_path))):
            errors.append(f"{args.rendered}: {name}: {where(error)}: {error.message}")
    for line in errors:
        print(line, file=sys.stderr)
    if args.rest is not None:
        args.rest.write_text(yaml.safe_dump_all(rest, sort_keys=False))
    kinds = {kind for _, kind in known}
    if missing := kinds - {kind for _, kind in seen}:
        print(f"{args.rendered}: no {', '.join(sorted(missing))} to validate", file=sys.stderr)
        return 2
    if not errors:
        print(f"{args.rendered}: {len(documents) - len(rest)} custom resources valid, {len(rest)} left for the rest")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
