#!/usr/bin/env bash
# Create .venv with swarmtrain and its test tools, from nothing.
# torch is installed first and pinned, so that pip never reaches for a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${SWARMTRAIN_TORCH:-2.13.0}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install --quiet "torch==${TORCH_VERSION}"
fi
.venv/bin/python -m pip install --quiet -e ".[test]"
# The dashboard test renders the page in headless Chromium (Debian's package). Installed here
# when this runs as root on a Debian-like system; otherwise install it yourself.
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq chromium >/dev/null
fi
command -v chromium >/dev/null || echo "note: the dashboard test needs headless Chromium (apt-get install chromium)"
echo "swarmtrain is set up in .venv ($(.venv/bin/python -c 'import torch, swarmtrain; print("swarmtrain", swarmtrain.__version__, "torch", torch.__version__)'))"
