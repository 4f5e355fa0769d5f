#!/usr/bin/env bash
# Step latency of 8 decoder processes x batch 32 against one server process, the service's
# latency target (step p99 <= 3 ms, >= 10k sequence-drafts/s per server process).
#
#   bash deploy/latency.sh [seconds=20] [draft_threads="1 4"] [corpus=../shared/data/corpora/sharegpt_v3_17671.json.gz]
#
# The first 3000 ShareGPT conversations are tokenized once (llama2 tokenizer) as requests never
# seen before. Then, for each --draft-threads value, a fresh `draftcache serve` (its embedded
# Redis in a new data dir) is measured by
#   - `draftcache bench-rpc`: the empty echo floor and a batch-1 / batch-32 draft on the stream,
#     back to back, in one run (what the machine's transport costs, against what drafting costs);
#   - `draftcache bench-load`: 8 decoder processes, batch 32, each verifying 20 ms after its
#     draft is answered, finished requests committed and replaced, the server's CPU sampled.
# On a host with cores for both (threads + 1 for the server and at least 2 more), the server runs
# on cores of its own and the benchmarks on the others (taskset), as on a serving host where the
# decoders live on other machines; otherwise they share every core, and the report says so.
# One JSON line per setting lands in latency/report.jsonl (the logs beside it). Paths given as
# arguments or in OUT, TOKENIZER and DRAFTCACHE_SHARED are read from the directory the script is
# started in.
set -euo pipefail
# shellcheck source=deploy/bench_common.sh
source "$(dirname "$0")/bench_common.sh"
SECONDS_EACH=${1:-20}
THREADS=${2:-"1 4"}
CORPUS=$(from_caller "${3:-$SHARED/data/corpora/sharegpt_v3_17671.json.gz}")
TOKENIZER=$(from_caller "${TOKENIZER:-$SHARED/data/tokenizers/llama2-spm}")
OUT=$(from_caller "${OUT:-$ROOT/latency}")
BIN=${DRAFTCACHE:-draftcache}
cd "$ROOT"
CORES=$(nproc)
rm -rf "$OUT"; mkdir -p "$OUT"
SERVER_PID=""
cleanup() { [ -z "$SERVER_PID" ] || kill "$SERVER_PID" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT

python - "$CORPUS" "$TOKENIZER" "$OUT/sharegpt.jsonl" <<'EOF'
import sys
from pathlib import Path
from benchmarks.traces import sharegpt_conversations, write_traces
from cache_service.admin import warm
encode, vocab = warm.load_tokenizer(Path(sys.argv[2]))
found = sharegpt_conversations(Path(sys.argv[1]), encode, vocab, namespace="llama2", limit=3000)
write_traces(found, Path(sys.argv[3]))
EOF

for T in $THREADS; do
  SERVER_CORES=$((T + 1))
  if [ $((CORES - SERVER_CORES)) -ge 2 ]; then
    PINNED=true
    ON_SERVER=(taskset -c "0-$((SERVER_CORES - 1))")
    ON_LOAD=(taskset -c "$SERVER_CORES-$((CORES - 1))")
  else
    PINNED=false; ON_SERVER=(); ON_LOAD=()
  fi
  PORT=$(port)
  "${ON_SERVER[@]}" "$BIN" serve --port "$PORT" --data-dir "$OUT/data_$T" --draft-threads "$T" \
    >"$OUT/serve_$T.log" 2>&1 &
  SERVER_PID=$!
  wait_healthy "$PORT"
  "${ON_LOAD[@]}" "$BIN" bench-rpc "$OUT/sharegpt.jsonl" --target "127.0.0.1:$PORT" --tokenizer "$TOKENIZER" \
    --batch 32 --steps 400 >"$OUT/rpc_$T.json"
  "${ON_LOAD[@]}" "$BIN" bench-load "$OUT/sharegpt.jsonl" --target "127.0.0.1:$PORT" --tokenizer "$TOKENIZER" \
    --decoders 8 --batch 32 --step-ms 20 --passes 0 --seconds "$SECONDS_EACH" --deadline-ms 500 \
    --watch-pid "$SERVER_PID" >"$OUT/load_$T.json"
  kill "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null || true; SERVER_PID=""
  python - "$OUT" "$T" "$PINNED" "$CORES" <<'EOF' | tee -a "$OUT/report.jsonl"
import json, sys
out, threads, pinned, cores = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "true", int(sys.argv[4])
rpc = json.load(open(f"{out}/rpc_{threads}.json"))
load = json.load(open(f"{out}/load_{threads}.json"))
print(json.dumps({
    "draft_threads": threads, "host_cores": cores, "server_on_own_cores": pinned,
    "echo_p50_ms": rpc["echo_unary"]["p50_ms"],
    "batch32_back_to_back_p50_ms": rpc["draft_stream_batch32"]["p50_ms"],
    "batch32_back_to_back_p99_ms": rpc["draft_stream_batch32"]["p99_ms"],
    "step_ms_p50": load["step_ms_p50"], "step_ms_p99": load["step_ms_p99"],
    "sequence_drafts_per_s": load["sequence_drafts_per_s"], "fallback_share": load["fallback_share"],
    "server_cpu_us_per_draft": load.get("server_cpu_us_per_draft"),
    "host_cpu_cores_used": load.get("host_cpu_cores_used"),
    "target_met": load["step_ms_p99"] <= 3.0 and load["sequence_drafts_per_s"] >= 10_000,
}))
EOF
done
