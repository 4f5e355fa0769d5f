#!/usr/bin/env bash
# Soak: two replicas on one Redis under decoder load for a while, with faults injected.
#
#   bash deploy/soak.sh [seconds=600] [decoders=8] [traces=../shared/data/traces/swe_agent_dev.jsonl.gz]
#
# Redis (fsync-always AOF) and two `draftcache serve` replicas run on loopback; `draftcache
# bench-load` drives them (batch 32, a 30 ms verification step) and samples both replicas'
# memory and CPU. Faults: Redis is SIGKILLed and restarted at 1/4 and 3/4 of the run, replica 2
# is SIGKILLed at 1/2 and restarted 5 s later. Decoders ride through on their local fallback.
# The JSON report lands in soak/report.json, the processes' logs beside them (each run starts
# afresh: OUT is emptied). Each replica keeps its commit journal in a data directory of its own
# (OUT/replica1, OUT/replica2): a journal is one process's, and replica 2's restart replays its own.
# Paths given as arguments or in OUT, TOKENIZER and DRAFTCACHE_SHARED are read from the directory
# the script is started in.
set -euo pipefail
# shellcheck source=deploy/bench_common.sh
source "$(dirname "$0")/bench_common.sh"
SECONDS_TOTAL=${1:-600}
DECODERS=${2:-8}
if [ "$SECONDS_TOTAL" -lt 40 ]; then
  echo "soak.sh: at least 40 seconds (the faults come 5 s apart at each quarter of the run)" >&2
  exit 2
fi
TRACES=$(from_caller "${3:-$SHARED/data/traces/swe_agent_dev.jsonl.gz}")
TOKENIZER=$(from_caller "${TOKENIZER:-$SHARED/data/tokenizers/smollm2}")
OUT=$(from_caller "${OUT:-$ROOT/soak}")
BIN=${DRAFTCACHE:-draftcache}
cd "$ROOT"
rm -rf "$OUT"; mkdir -p "$OUT/redis"
REDIS_PORT=$(port); P1=$(port); P2=$(port)
REDIS_BIN=$(python -c 'from cache_service.host.embedded_redis import find_server_binary; print(find_server_binary())')
URL="redis://127.0.0.1:$REDIS_PORT/0"

start_redis() {
  "$REDIS_BIN" --bind 127.0.0.1 --port "$REDIS_PORT" --dir "$OUT/redis" --appendonly yes \
    --appendfsync always --save "" >>"$OUT/redis.log" 2>&1 &
  REDIS_PID=$!
  echo "$REDIS_PID" >"$OUT/redis.pid"
  for _ in $(seq 100); do python -c "import redis; redis.Redis.from_url('$URL').ping()" 2>/dev/null && return; sleep 0.1; done
  echo "redis did not start" >&2; exit 1
}
start_replica() {  # $1: replica number, $2: port; its pid goes to OUT/replica<n>.pid
  "$BIN" serve --port "$2" --redis-url "$URL" --data-dir "$OUT/replica$1" >>"$OUT/replica$1.log" 2>&1 &
  echo $! >"$OUT/replica$1.pid"
}
FAULTS=""
cleanup() {  # the fault loop first (it restarts processes, whose pids are in files), then the processes
  if [ -n "$FAULTS" ]; then
    local pending
    pending=$(pgrep -P "$FAULTS" || true)  # its sleep, or a start it is waiting on
    kill "$FAULTS" 2>/dev/null || true
    # shellcheck disable=SC2086
    kill $pending 2>/dev/null || true
  fi
  local pids=() f pid
  for f in "$OUT/replica1.pid" "$OUT/replica2.pid" "$OUT/redis.pid"; do
    [ ! -f "$f" ] || pids+=("$(cat "$f")")
  done
  kill "${pids[@]}" 2>/dev/null || true
  # A process the fault loop started is not this shell's child: wait for it by its pid.
  for pid in "${pids[@]}"; do
    for _ in $(seq 600); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  done
  wait 2>/dev/null || true
}
trap cleanup EXIT

start_redis
start_replica 1 "$P1"; R1=$!
start_replica 2 "$P2"; R2=$!
wait_healthy "$P1" 120; wait_healthy "$P2" 120

faults() {
  sleep $((SECONDS_TOTAL / 4)); echo "$(date +%T) fault: redis SIGKILL" >>"$OUT/faults.log"
  kill -9 "$REDIS_PID"; sleep 5; start_redis; echo "$(date +%T) redis back" >>"$OUT/faults.log"
  sleep $((SECONDS_TOTAL / 4 - 5)); echo "$(date +%T) fault: replica 2 SIGKILL" >>"$OUT/faults.log"
  kill -9 "$R2"; sleep 5; start_replica 2 "$P2"; R2=$!
  wait_healthy "$P2" 120
  echo "$(date +%T) replica 2 back (pid $R2)" >>"$OUT/faults.log"
  sleep $((SECONDS_TOTAL / 4 - 5)); echo "$(date +%T) fault: redis SIGKILL" >>"$OUT/faults.log"
  kill -9 "$REDIS_PID"; sleep 5; start_redis; echo "$(date +%T) redis back" >>"$OUT/faults.log"
}
faults &
FAULTS=$!
"$BIN" bench-load "$TRACES" --tokenizer "$TOKENIZER" --target "127.0.0.1:$P1" --target "127.0.0.1:$P2" \
  --decoders "$DECODERS" --batch 32 --step-ms 30 --deadline-ms 20 --passes 0 --seconds "$SECONDS_TOTAL" \
  --watch-pid "$R1" --watch-pid "$R2" --watch-pid "$REDIS_PID" --timeline 60 | tee "$OUT/report.json"
wait "$FAULTS" || echo "the fault loop failed: see $OUT/faults.log" >&2
FAULTS=""
"$BIN" stats --target "127.0.0.1:$P1" | tee -a "$OUT/report.json"
