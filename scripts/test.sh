#!/usr/bin/env bash
# Set up (see scripts/setup.sh) and run the default test suite, then the float-path-sensitive
# tests (marker `numerics`, less the `costly` ones) again under other CPU kernels: PyTorch picks
# its kernels by instruction set, so a tolerance that holds only on this machine's would fail on
# another. Reruns: ATEN_CPU_CAPABILITY=default (the plain C++ kernels), and avx2 when this CPU has
# AVX2 and is not already running it. Extra arguments go to the first run only;
# SOFTTRUST_NUMERICS_RERUN=0 skips the reruns.
# Long checks are behind the `slow` marker: add `-m slow` to run them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m ruff check .
.venv/bin/python -m ruff format --check .
.venv/bin/python -m pytest -q "$@"
[[ "${SOFTTRUST_NUMERICS_RERUN:-1}" == 0 ]] && exit 0

capability() { ATEN_CPU_CAPABILITY="${1:-}" .venv/bin/python -c \
  "import torch; print(torch.backends.cpu.get_cpu_capability().lower())"; }
native=$(capability)
reruns=()
[[ "$native" != default ]] && reruns+=(default)
[[ "$native" == avx512 ]] && reruns+=(avx2)  # an AVX-512 CPU has AVX2; on an AVX2 CPU it is the first run
for isa in "${reruns[@]}"; do
  got=$(capability "$isa")
  if [[ "$got" != "$isa" ]]; then
    echo "ATEN_CPU_CAPABILITY=$isa gives $got on this machine: the rerun would repeat the first run" >&2
    exit 1
  fi
  echo "== numerics rerun: ATEN_CPU_CAPABILITY=$isa (this CPU: $native)"
  ATEN_CPU_CAPABILITY=$isa .venv/bin/python -m pytest -q -m "numerics and not costly and not slow"
done
