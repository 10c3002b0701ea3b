#!/usr/bin/env bash
# One-time set-up, repeated cheaply: a virtual environment in .venv that sees the system's packages
# (so an existing CUDA build of torch is reused), torch 2.13.0 only if none is importable, then this
# package with its test dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q torch==2.13.0
fi
.venv/bin/python -m pip install -q -e ".[test]"
