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
# verl for the verl adapter's tests: its import-time dependencies come with the dev extra
# (verl-import); verl's full dependency set would pull ray[default], wandb, peft and pin
# transformers<5.11, none of which `import verl` or its loss registry needs.
.venv/bin/python -m pip install --quiet --no-deps "verl==0.9.1"
