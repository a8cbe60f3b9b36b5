#!/usr/bin/env bash
# Install nki-lib with its test extras and run the whole test suite (the Quickstart's second command).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || pip install --quiet "torch==2.13.0"
pip install --quiet -e ".[test]"
HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}" python -m pytest -q -p no:cacheprovider "$@"
