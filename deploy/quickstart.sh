#!/usr/bin/env bash
# The main job on a fresh machine: set up .venv (the service and its tools, no torch), warm a
# static prior from the ShareGPT corpus (once: the file is kept in data/), start the service on
# its embedded persistent Redis with an empty memory, publish the prior into it and replay the
# Spec-Bench trace through gRPC beside prompt lookup (and SuffixDecoding when installed): the cold
# start. Then restart the service on the same data and replay the same trace again: the same
# traffic answered by a cache that has kept it. Every run prints the same cold figure.
set -euo pipefail
# Paths given in DRAFTCACHE_SHARED and DRAFTCACHE_DATA_DIR are read from where the script is
# started; the defaults are beside the project root and in it.
from_caller() { case "$1" in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$PWD/$1" ;; esac; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SHARED=$(from_caller "${DRAFTCACHE_SHARED:-$ROOT/../shared}")
DATA=$(from_caller "${DRAFTCACHE_DATA_DIR:-$ROOT/data}")
cd "$ROOT"
SETUP_EXTRAS="${SETUP_EXTRAS:-embedded}" source deploy/setup_env.sh
PORT="${DRAFTCACHE_PORT:-50051}"
TARGET="127.0.0.1:$PORT"
TOKENIZER="$SHARED/data/tokenizers/llama2-spm"
TRACE="$SHARED/data/traces/spec_bench_vicuna7b.jsonl.gz"
PRIOR="$DATA/prior-llama2.npz"
RUN="$DATA/quickstart"  # the service's data for this run only: emptied at the start

# A port in use is refused before anything starts (the service would refuse it too, after
# starting its storage and compiling its kernels).
if ! python -c 'import socket, sys; socket.socket().bind(("127.0.0.1", int(sys.argv[1])))' "$PORT" 2>/dev/null; then
  echo "port $PORT is in use: stop what listens there, or set DRAFTCACHE_PORT to a free port" >&2
  exit 1
fi

if [ ! -f "$PRIOR" ]; then
  draftcache warm --namespace llama2 --tokenizer "$TOKENIZER" \
    --corpus "$SHARED/data/corpora/sharegpt_v3_17671.json.gz" --format sharegpt --out "$PRIOR"
fi

SERVER=""
start_service() {
  draftcache serve --port "$PORT" --data-dir "$RUN" &
  SERVER=$!
  echo "waiting for the service (the first start on a machine compiles its kernels: a few minutes)"
  for _ in $(seq 1 600); do
    kill -0 "$SERVER" 2>/dev/null || { echo "the service failed to start" >&2; exit 1; }
    python deploy/healthcheck.py "$TARGET" >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  echo "the service did not answer in 5 minutes" >&2
  exit 1
}
stop_service() {
  if [ -n "$SERVER" ]; then
    kill -TERM "$SERVER" 2>/dev/null || true
    wait "$SERVER" 2>/dev/null || true
    SERVER=""
  fi
  # A service stopped while it is still starting exits without stopping its embedded Redis,
  # which would run on: stop it by the pid it left (a clean stop removes the file).
  local pid
  pid=$(cat "$RUN/redis/server.pid" 2>/dev/null) || return 0
  if grep -qa -e valkey-server -e redis-server "/proc/$pid/cmdline" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  fi
}
trap stop_service EXIT
mat() { python -c 'import json, sys; print("%.3f" % json.load(sys.stdin)["results"][0]["mat"])'; }

rm -rf "$RUN"
start_service
draftcache warm --namespace llama2 --tokenizer "$TOKENIZER" --from-prior "$PRIOR" --data-dir "$RUN"
draftcache rebuild --target "$TARGET" --namespace llama2 >/dev/null
echo "== cold start: an empty lifetime memory, the ShareGPT prior"
draftcache replay "$TRACE" --target "$TARGET" --baselines prompt-lookup,suffix-decoding "$@" | tee "$RUN/cold.txt"

echo "== restart: the service stops and starts again on the same data"
stop_service
start_service
draftcache stats --target "$TARGET"
echo "== the same traffic again, answered from the memory the service kept"
draftcache replay "$TRACE" --target "$TARGET" --json "$@" > "$RUN/warm.json"
WARM=$(mat < "$RUN/warm.json")
COLD=$(awk '$1 ~ /^draftcache@/ {print $2; exit}' "$RUN/cold.txt")
echo "MAT through the service: cold start ${COLD:-?}; after a restart, on traffic it has seen: $WARM"
