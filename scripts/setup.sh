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
    probe=$(mktemp -d)
    if .venv/bin/python -m pip download --quiet --no-index --no-deps -d "$probe" "torch==${TORCH_VERSION}" \
            >/dev/null 2>&1; then
        # a local wheel (pip's find-links, e.g. a CPU build kept on disk): use it
        .venv/bin/python -m pip install --quiet "torch==${TORCH_VERSION}"
    elif [ "$(uname -s)" = Linux ]; then
        # PyPI's Linux wheels pull several GB of CUDA libraries; PyTorch's CPU index does not
        .venv/bin/python -m pip install --quiet "torch==${TORCH_VERSION}" \
            --index-url "${SWARMTRAIN_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" \
            --extra-index-url https://pypi.org/simple
    else
        .venv/bin/python -m pip install --quiet "torch==${TORCH_VERSION}"  # macOS: CPU wheels
    fi
    rm -rf "$probe"
fi
.venv/bin/python -m pip install --quiet -e ".[test]"
# The dashboard test renders the page in headless Chromium (Debian's package). Installed here
# when this runs as root on a Debian-like system; otherwise install it yourself.
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq chromium >/dev/null
fi
command -v chromium >/dev/null || echo "note: the dashboard test needs headless Chromium (apt-get install chromium)"
echo "swarmtrain is set up in .venv ($(.venv/bin/python -c 'import torch, swarmtrain; print("swarmtrain", swarmtrain.__version__, "torch", torch.__version__)'))"
