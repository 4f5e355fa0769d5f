#!/usr/bin/env bash
# The test command: sets up everything on a fresh machine, then lint, types and tests.
#   bash tests/run.sh            # default suite (fast)
#   bash tests/run.sh -m slow    # extra pytest arguments pass through
set -euo pipefail
cd "$(dirname "$0")/.."
source deploy/setup_env.sh
echo "== ruff"
python -m ruff check .
python -m ruff format --check .
echo "== mypy"
python -m mypy
echo "== pytest"
python -m pytest "$@"
