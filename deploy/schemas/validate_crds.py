#!/usr/bin/env python3
"""Validate custom resources against the CRD schemas vendored in this directory.

Usage: validate_crds.py MANIFEST.yaml...

Every resource whose API group has a vendored CRD (see SOURCES.md) is checked against that CRD's
openAPIV3Schema for its version, strictly: unknown fields are errors unless the schema says
x-kubernetes-preserve-unknown-fields. A resource of any other non-built-in group is an error (so
nothing goes unchecked); built-in groups are left to `kubernetes-validate --strict`. CEL rules
(x-kubernetes-validations) are not evaluated. Prints one OK/ERROR line per custom resource and
exits 1 on any error.
"""

import copy
import pathlib
import sys

import jsonschema
import yaml

HERE = pathlib.Path(__file__).resolve().parent

# Groups served by the Kubernetes API server itself (kubernetes-validate has their schemas).
BUILTIN_GROUPS = {
    "", "apps", "batch", "autoscaling", "policy", "rbac.authorization.k8s.io",
    "networking.k8s.io", "storage.k8s.io", "scheduling.k8s.io", "coordination.k8s.io",
    "discovery.k8s.io", "admissionregistration.k8s.io", "apiextensions.k8s.io",
    "certificates.k8s.io", "node.k8s.io", "flowcontrol.apiserver.k8s.io",
}


def strict(node):
    """openAPIV3Schema (structural) -> JSON Schema with additionalProperties: false."""
    if isinstance(node, list):
        return [strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable"):
        out.pop("nullable")
        if "type" in out:
            out["type"] = [out["type"], "null"]
    preserve = node.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in node and not preserve and "additionalProperties" not in node:
        out["additionalProperties"] = False
    if node.get("x-kubernetes-embedded-resource") and "properties" in out:
        for k in ("apiVersion", "kind"):
            out["properties"].setdefault(k, {"type": "string"})
        out["properties"].setdefault("metadata", {"type": "object"})
    return out


def load_crds():
    crds = {}
    for path in sorted(HERE.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for v in spec["versions"]:
                if not v.get("served", True):
                    continue
                schema = strict(copy.deepcopy(v["schema"]["openAPIV3Schema"]))
                # The API server always accepts these, whether or not a CRD lists them.
                props = schema.setdefault("properties", {})
                props.setdefault("apiVersion", {"type": "string"})
                props.setdefault("kind", {"type": "string"})
                props.setdefault("metadata", {"type": "object"})
                key = (spec["group"], v["name"], spec["names"]["kind"])
                crds[key] = (path.relative_to(HERE), schema)
    return crds


def main(files):
    crds = load_crds()
    errors = 0
    for f in files:
        for res in yaml.safe_load_all(pathlib.Path(f).read_text()):
            if not res:
                continue
            api_version = res.get("apiVersion", "")
            group, _, version = api_version.rpartition("/")
            kind = res.get("kind", "")
            name = f"{kind}/{res.get('metadata', {}).get('name', '?')}"
            if group in BUILTIN_GROUPS:
                continue
            found = crds.get((group, version, kind))
            if not found:
                print(f"ERROR {f}: {name}: no vendored CRD schema for {api_version} {kind}")
                errors += 1
                continue
            source, schema = found
            validator = jsonschema.Draft7Validator(schema)
            problems = sorted(validator.iter_errors(res), key=lambda e: list(e.path))
            for e in problems:
                path = ".".join(str(p) for p in e.path) or "(root)"
                print(f"ERROR {f}: {name}: {path}: {e.message}")
            errors += len(problems)
            if not problems:
                print(f"OK {f}: {name} against {source} ({api_version})")
    return 1 if errors else 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1:]))
