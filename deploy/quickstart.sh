#!/usr/bin/env bash
# The main job on a fresh machine: set up, warm a static prior from the ShareGPT corpus, replay
# the Spec-Bench trace through draftcache beside prompt lookup, and print tokens per step (MAT).
set -euo pipefail
cd "$(dirname "$0")/.."
source deploy/setup_env.sh
SHARED="${DRAFTCACHE_SHARED:-../shared}"
DATA="${DRAFTCACHE_DATA_DIR:-data}"
mkdir -p "$DATA"
draftcache replay "$SHARED/data/traces/spec_bench_vicuna7b.jsonl.gz" \
  --tokenizer "$SHARED/data/tokenizers/llama2-spm" \
  --warm-corpus "$SHARED/data/corpora/sharegpt_v3_17671.json.gz" \
  --prior-cache "$DATA/prior-llama2.npz" \
  --baselines prompt-lookup,suffix-decoding "$@"
