#!/usr/bin/env bash
# Install nki-lib with its test extras and run the whole test suite (the Quickstart's second command).
set -euo pipefail
cd "$(dirname "$0")/.."
# The simulator multiplies small tiles; multi-threaded BLAS only adds overhead (and thrashes on 2 cores).
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
python -c "import torch" 2>/dev/null || pip install --quiet "torch==2.13.0"
pip install --quiet -e ".[test]"
HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}" python -m pytest -q -p no:cacheprovider "$@"
