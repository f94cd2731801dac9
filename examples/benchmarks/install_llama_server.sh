#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` (parallel slots, continuous batching), once per machine.
#
# Source: the llama.cpp tree vendored in llama-cpp-python's sdist on PyPI (this machine reaches
# package registries only). Location: ${PREFIXGATE_LLAMA_DIR:-$HOME/.cache/prefixgate/llama.cpp-<version>},
# where <version> is llama-cpp-python's. Idempotent: exits at once when bin/llama-server is there.
# Only the server target is built (nice ${NICE:-10}, ${JOBS:-2} jobs): about 15-20 minutes on 2 quiet
# cores, far longer on a busy machine (about 200 objects).
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
DIR="${PREFIXGATE_LLAMA_DIR:-$HOME/.cache/prefixgate/llama.cpp-${VERSION}}"
JOBS="${JOBS:-2}"

if [ -x "$DIR/bin/llama-server" ]; then
    echo "llama-server already installed in $DIR"
    "$DIR/bin/llama-server" --version 2>&1 | head -n 2 || true
    exit 0
fi

# the build tree is kept beside $DIR until the binary is installed, so a second run resumes it
WORK="${DIR}.build"
mkdir -p "$WORK"
mkdir -p "$DIR"
[ -d "$(echo "$WORK"/llama_cpp_python-*/vendor/llama.cpp)" ] || {
python3 -m pip download --quiet --no-deps --no-binary :all: -d "$WORK" "llama-cpp-python==${VERSION}"
tar -xzf "$WORK"/llama_cpp_python-*.tar.gz -C "$WORK"
}
SRC="$(echo "$WORK"/llama_cpp_python-*/vendor/llama.cpp)"
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON
nice -n "${NICE:-10}" cmake --build "$WORK/build" --target llama-server -j "$JOBS"
mkdir -p "$DIR/bin"
cp "$WORK/build/bin/llama-server" "$DIR/bin/"
"$DIR/bin/llama-server" --version 2>&1 | head -n 2 || true
rm -rf "$WORK"
echo "llama-server installed in $DIR/bin"
