#!/usr/bin/env python3
"""Validates the rendered manifests' custom resources against the JSON schemas in a directory.

Usage: check_custom_resources.py SCHEMA_DIR NAME=RENDERED.yaml ...

kubernetes-validate knows the built-in kinds only: it skips an InferencePool or an HTTPRoute
with a warning. Each SCHEMA_DIR/*.json is a JSON Schema (draft 2020-12) of one custom kind,
naming it by its `apiVersion` and `kind` consts; every object of those kinds in a render is
validated against it with the `jsonschema` package, and an object of a kind that neither a
schema here nor kubernetes-validate knows is a failure too, so that nothing goes unvalidated.
Each error is printed with the path of the offending field (spec.targetPorts, ...).
Exits 1 with every failure listed.
"""

import glob
import json
import os
import sys

import jsonschema
import kubernetes_validate
import yaml


def load_schemas(directory):
    schemas = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        schema = json.load(open(path))
        cls = jsonschema.validators.validator_for(schema)
        cls.check_schema(schema)  # a broken schema would validate nothing
        props = schema.get("properties") or {}
        key = ((props.get("apiVersion") or {}).get("const"), (props.get("kind") or {}).get("const"))
        if None in key:
            sys.exit(f"{path}: no apiVersion and kind consts: which kind is it for?")
        schemas[key] = (os.path.basename(path), cls(schema, format_checker=cls.FORMAT_CHECKER))
    if not schemas:
        sys.exit(f"no schema in {directory}")
    return schemas


def field_path(error):
    out = ""
    for p in error.absolute_path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(the object)"


def known_to_kubernetes_validate(doc):
    try:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=False)
    except kubernetes_validate.SchemaNotFoundError:
        return False
    except Exception:  # invalid, but a built-in kind: manifests.sh's strict run reports it
        pass
    return True


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    schemas = load_schemas(sys.argv[1])
    failures = 0
    for arg in sys.argv[2:]:
        name, _, path = arg.partition("=")
        counts = {}
        before = failures
        for doc in yaml.safe_load_all(open(path)):
            if not doc:
                continue
            key = (doc.get("apiVersion"), doc.get("kind"))
            what = f"{name}: {doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
            if key not in schemas:
                if not known_to_kubernetes_validate(doc):
                    print(f"FAIL {what}: no schema for {key[0]} {key[1]}, in {sys.argv[1]} "
                          "or kubernetes-validate")
                    failures += 1
                continue
            file, validator = schemas[key]
            errors = sorted(validator.iter_errors(doc),
                            key=lambda e: list(map(str, e.absolute_path)))
            for e in errors:
                msg = e.message
                if len(msg) > 240:
                    msg = msg[:200] + " ... " + msg[-35:]
                print(f"FAIL {what}: {field_path(e)}: {msg} ({file})")
            failures += len(errors)
            counts[key[1]] = counts.get(key[1], 0) + 1
        if counts and failures == before:
            kinds = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
            print(f"ok   {name}: custom resources checked against {sys.argv[1]}: {kinds}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
