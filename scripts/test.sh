#!/usr/bin/env bash
# Install nki-lib with its test extras and run the whole test suite (the Quickstart's second command).
set -euo pipefail
cd "$(dirname "$0")/.."
# The simulator multiplies small tiles; multi-threaded BLAS only adds overhead (and thrashes on 2 cores).
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
bash scripts/install_torch_cpu.sh
python -m pip install --quiet -e ".[test]"
# Lint first (pyflakes rules, import order; config in pyproject.toml): CI fails on a finding.
python -m ruff check .
HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}" python -m pytest -q -p no:cacheprovider "$@"
