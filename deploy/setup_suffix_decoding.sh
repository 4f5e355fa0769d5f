#!/usr/bin/env bash
# vLLM's `suffix` speculative method (SuffixDecoding) imports arctic-inference, which has no
# wheel for this platform: this builds arctic-inference 0.1.1 (the version vLLM names) from its
# source package and installs it into the vLLM virtualenv (.venv-vllm, deploy/setup_vllm.sh).
#   bash deploy/setup_suffix_decoding.sh      # idempotent: seconds once it imports
#
# Why not `pip install arctic-inference==0.1.1`: its build requirements pin torch==2.7.0, which an
# isolated build fetches as a CUDA build of several GB, and install it beside vLLM and it would
# move vLLM's torch. vLLM's `suffix` needs only its suffix-tree extension (C++ through nanobind;
# the build script imports torch only to find its CMake files), so the wheel is built without
# build isolation in a throwaway environment that sees the vLLM virtualenv's own torch, and
# installed without dependencies. Its vLLM plugin stays off unless ARCTIC_INFERENCE_ENABLED=1.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${DRAFTCACHE_VLLM_VENV:-.venv-vllm}"
VERSION="0.1.1"

if "$VENV/bin/python" -c "import arctic_inference.suffix_decoding" 2>/dev/null; then
  exit 0
fi
BUILD="$(mktemp -d)"
trap 'rm -rf "$BUILD"' EXIT
"$VENV/bin/python" -m venv "$BUILD/env"
# The vLLM environment's packages after the build environment's own: torch comes from there.
"$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
  > "$("$BUILD/env/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/vllm-venv.pth"
"$BUILD/env/bin/pip" install -q setuptools wheel ninja cmake "nanobind==2.9.2" grpcio-tools
# Without VIRTUAL_ENV: CMake's FindPython would pick an activated virtualenv's interpreter
# (the project's .venv, when a benchmark script set it up first), which has no nanobind.
env -u VIRTUAL_ENV PATH="$BUILD/env/bin:$PATH" "$BUILD/env/bin/pip" wheel -q --no-deps --no-build-isolation --no-binary arctic-inference \
  -w "$BUILD/wheels" "arctic-inference==$VERSION"
"$VENV/bin/pip" install -q --no-deps "$BUILD"/wheels/arctic_inference-*.whl
"$VENV/bin/python" -c "import arctic_inference.suffix_decoding"
