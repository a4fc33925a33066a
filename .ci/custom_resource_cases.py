#!/usr/bin/env python3
"""Writes deliberately broken copies of a render, to prove the custom resources' schemas bite.

Usage: custom_resource_cases.py OUTDIR RENDERED.yaml

RENDERED.yaml is a render with an InferencePool and an HTTPRoute (the inference-gateway
overlay's). For each case below, OUTDIR gets CASE.yaml, the whole render with one field of one
object broken, and CASE.expect, the path of the field that check_custom_resources.py must
report. .ci/manifests.sh runs the check on each copy and fails unless it fails there.
"""

import copy
import os
import sys

import yaml


def pool(docs):
    return next(d for d in docs if d.get("kind") == "InferencePool")


def route(docs):
    return next(d for d in docs if d.get("kind") == "HTTPRoute")


def gateway(docs):
    return next(d for d in docs if d.get("kind") == "Gateway")


def backend(docs):
    return route(docs)["spec"]["rules"][0]["backendRefs"][0]


def set_labels(n):
    def f(docs):
        pool(docs)["spec"]["selector"]["matchLabels"] = {f"example.com/l{i}": "x" for i in range(n)}
    return f


def set_ports(numbers):
    def f(docs):
        pool(docs)["spec"]["targetPorts"] = [{"number": n} for n in numbers]
    return f


def setter(get, key, value):
    def f(docs):
        get(docs)[key] = value
    return f


def deleter(get, key):
    def f(docs):
        del get(docs)[key]
    return f


def epp_ref(docs):
    return pool(docs)["spec"]["endpointPickerRef"]


def pool_spec(docs):
    return pool(docs)["spec"]


# (case, the path check_custom_resources.py must report, the breakage)
CASES = [
    ("pool-no-labels", "spec.selector.matchLabels", set_labels(0)),
    ("pool-65-labels", "spec.selector.matchLabels", set_labels(65)),
    ("pool-bad-label-key", "spec.selector.matchLabels",
     setter(lambda d: pool(d)["spec"]["selector"], "matchLabels", {"-bad key": "x"})),
    ("pool-no-ports", "spec.targetPorts", set_ports([])),
    ("pool-9-ports", "spec.targetPorts", set_ports(range(8000, 8009))),
    ("pool-duplicate-port", "spec.targetPorts", set_ports([8000, 8001, 8000])),
    ("pool-port-0", "spec.targetPorts[0].number", set_ports([0])),
    ("pool-port-65536", "spec.targetPorts[0].number", set_ports([65536])),
    ("pool-bad-app-protocol", "spec.appProtocol", setter(pool_spec, "appProtocol", "h2c")),
    ("pool-no-epp-ref", "spec", deleter(pool_spec, "endpointPickerRef")),
    ("pool-bad-failure-mode", "spec.endpointPickerRef.failureMode",
     setter(epp_ref, "failureMode", "FailClosed")),
    ("pool-epp-ref-no-port", "spec.endpointPickerRef", deleter(epp_ref, "port")),
    ("pool-epp-ref-port-string", "spec.endpointPickerRef.port.number",
     setter(lambda d: epp_ref(d)["port"], "number", "9002")),
    # v1alpha2's field, not v1's.
    ("pool-unknown-field", "spec", setter(pool_spec, "targetPortNumber", 8000)),
    # The v1alpha2 group of InferencePool.
    ("route-alpha-group", "spec.rules[0].backendRefs[0]",
     setter(backend, "group", "inference.networking.x-k8s.io")),
    ("route-pool-core-group", "spec.rules[0].backendRefs[0]", setter(backend, "group", "")),
    ("route-pool-no-group", "spec.rules[0].backendRefs[0]", deleter(backend, "group")),
    ("route-wrong-kind", "spec.rules[0].backendRefs[0]", setter(backend, "kind", "Pool")),
    ("route-service-without-port", "spec.rules[0].backendRefs[0]",
     lambda d: route(d)["spec"]["rules"][0].update(backendRefs=[{"kind": "Service", "name": "x"}])),
    ("route-relative-path", "spec.rules[0].matches[0].path.value",
     setter(lambda d: route(d)["spec"]["rules"][0]["matches"][0]["path"], "value", "v1")),
    ("gateway-no-listeners", "spec.listeners",
     setter(lambda d: gateway(d)["spec"], "listeners", [])),
]


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    out, render = sys.argv[1], sys.argv[2]
    docs = [d for d in yaml.safe_load_all(open(render)) if d]
    os.makedirs(out, exist_ok=True)
    for name, expect, breakage in CASES:
        broken = copy.deepcopy(docs)
        breakage(broken)
        with open(os.path.join(out, f"{name}.yaml"), "w") as f:
            yaml.safe_dump_all(broken, f, sort_keys=False)
        with open(os.path.join(out, f"{name}.expect"), "w") as f:
            f.write(expect + "\n")


if __name__ == "__main__":
    main()
