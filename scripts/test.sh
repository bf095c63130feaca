#!/usr/bin/env bash
# Set up (see scripts/setup.sh) and run the default test suite.
# Long checks are behind the `slow` marker: add `-m slow` to run them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m ruff check .
.venv/bin/python -m ruff format --check .
exec .venv/bin/python -m pytest -q "$@"
