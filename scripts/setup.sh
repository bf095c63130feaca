#!/usr/bin/env bash
# Create ./.venv (if missing) and install softtrust with every extra.
# torch==2.13.0 goes first: with torch already present, pip keeps it instead of
# pulling a multi-GB CUDA build for the `torch>=2.4` requirement.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[dev]"
