#!/usr/bin/env bash
# Set up (see scripts/setup.sh) and run the main job: `softtrust train` on the
# embedded default (tiny Qwen2 + built-in verifiable task), offline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/softtrust train "$@"
