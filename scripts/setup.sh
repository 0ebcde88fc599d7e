#!/usr/bin/env bash
# Install everything UnSparse needs on a fresh Debian machine (run as root): Debian's Fashion-MNIST
# package, a Python 3.11 virtualenv in .venv with torch/torchvision from this machine's local wheels,
# the package itself (editable, so configs/ and kernels/ are found) and the dev tools. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist
fi

PYTHON=${PYTHON:-python3.11}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch, torchvision" 2>/dev/null; then
    .venv/bin/pip install -q torch==2.14.1 torchvision==0.29.1 2>&1 | grep -v "is ignored: it is neither" || true
    .venv/bin/python -c "import torch, torchvision"
fi
.venv/bin/pip install -q -e ".[dev]" 2>&1 | grep -v "is ignored: it is neither" || true
.venv/bin/python -c "import unsparse, hydra, safetensors, sklearn"
