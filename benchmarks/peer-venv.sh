#!/usr/bin/env bash
# Creates the separate virtualenv that benchmarks/compare.py runs sentence-transformers' OpenVINO contenders in.
# optimum-intel pins a transformers version that conflicts with bertopt's, so the peers get their own venv.
#   benchmarks/peer-venv.sh [VENV]      (default: peer-venv next to the repository's .venv)
# torch 2.13.0 (CPU) first, so nothing pulls another build; torchvision is removed afterwards: the version the
# resolver picks breaks torch 2.13's operator registry ("operator torchvision::nms does not exist").
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/peer-venv}"
PYTHON="${PYTHON:-python3}"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" torch==2.13.0 sentence-transformers 'optimum-intel[openvino]' 'datasets<5' 'huggingface-hub>=1.5,<1.22'
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision || true
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for name in ("torch", "transformers", "sentence-transformers", "optimum-intel", "openvino", "nncf"):
    print(f"{name} {md.version(name)}")
PY
touch "$VENV/.peer-venv-ready"
