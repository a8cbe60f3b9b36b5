#!/usr/bin/env bash
# Install the CPU build of torch 2.13.0 into the active Python when torch is missing.
# Never a CUDA build: the local version "+cpu" pins the CPU wheel (a local wheel cache or
# PyTorch's CPU index); plain PyPI's torch for Linux is the CUDA build.
set -euo pipefail
if python -c "import torch" 2>/dev/null; then
    exit 0
fi
python -m pip install --quiet "torch==2.13.0+cpu" 2>/dev/null \
    || python -m pip install --quiet --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
python - <<'PY'
import torch
assert torch.version.cuda is None, f"a CUDA build of torch was installed: {torch.__version__}"
print(f"torch {torch.__version__} (CPU)")
PY
