#!/usr/bin/env bash
# Installs the pinned kubernetes-validate (PyPI; it carries the Kubernetes JSON schemas, so validating
# needs no cluster and no network) into <repo>/.venv-k8s, once. tests/tests/k8s.rs runs it, and its
# Python (with PyYAML) to read the manifests.
set -euo pipefail
venv="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv-k8s"
if [ ! -x "$venv/bin/kubernetes-validate" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q kubernetes-validate==1.37.0
fi
