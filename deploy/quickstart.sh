#!/usr/bin/env bash
# The main job on a fresh machine: set up, start the service on its embedded persistent Redis,
# warm a static prior from the ShareGPT corpus into it, replay the Spec-Bench trace through gRPC
# beside prompt lookup (and SuffixDecoding when installed), print tokens per step (MAT), stop.
set -euo pipefail
cd "$(dirname "$0")/.."
source deploy/setup_env.sh
SHARED="${DRAFTCACHE_SHARED:-../shared}"
DATA="${DRAFTCACHE_DATA_DIR:-data}"
PORT="${DRAFTCACHE_PORT:-50051}"
TARGET="127.0.0.1:$PORT"

draftcache serve --port "$PORT" --data-dir "$DATA" &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  draftcache stats --target "$TARGET" >/dev/null 2>&1 && break
  kill -0 $SERVER 2>/dev/null || { echo "the service failed to start" >&2; exit 1; }
  sleep 0.5
done

# The prior lives in the service's Redis and survives restarts: warm it once.
if ! draftcache stats --target "$TARGET" --namespace llama2 2>/dev/null | grep -q "prior v[1-9]"; then
  draftcache warm --namespace llama2 --tokenizer "$SHARED/data/tokenizers/llama2-spm" \
    --corpus "$SHARED/data/corpora/sharegpt_v3_17671.json.gz" --format sharegpt --data-dir "$DATA"
fi
draftcache rebuild --target "$TARGET" --namespace llama2 >/dev/null
draftcache stats --target "$TARGET"
draftcache replay "$SHARED/data/traces/spec_bench_vicuna7b.jsonl.gz" --target "$TARGET" \
  --tokenizer "$SHARED/data/tokenizers/llama2-spm" \
  --baselines prompt-lookup,suffix-decoding "$@"
