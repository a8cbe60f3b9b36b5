#!/usr/bin/env bash
# Install nki-lib and run the main job: the kernel report (parity and estimated device performance).
set -euo pipefail
cd "$(dirname "$0")/.."
# The simulator multiplies small tiles; multi-threaded BLAS only adds overhead (and thrashes on 2 cores).
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
bash scripts/install_torch_cpu.sh
python -m pip install --quiet -e .
python -m nki_lib report "$@"
