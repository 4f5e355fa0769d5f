#!/usr/bin/env bash
# Soak: two replicas on one Redis under decoder load for a while, with faults injected.
#
#   bash deploy/soak.sh [seconds=600] [decoders=8] [traces=../shared/data/traces/swe_agent_dev.jsonl.gz]
#
# Redis (fsync-always AOF) and two `draftcache serve` replicas run on loopback; `draftcache
# bench-load` drives them (batch 32, a 30 ms verification step) and samples both replicas'
# memory and CPU. Faults: Redis is SIGKILLed and restarted at 1/4 and 3/4 of the run, replica 2
# is SIGKILLed at 1/2 and restarted 5 s later. Decoders ride through on their local fallback.
# The JSON report lands in soak/report.json, the processes' logs beside it.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_TOTAL=${1:-600}
DECODERS=${2:-8}
TRACES=${3:-../shared/data/traces/swe_agent_dev.jsonl.gz}
TOKENIZER=${TOKENIZER:-../shared/data/tokenizers/smollm2}
OUT=${OUT:-soak}
BIN=${DRAFTCACHE:-draftcache}
mkdir -p "$OUT/redis"
source deploy/bench_common.sh
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
start_replica() {  # $1: port, $2: log
  "$BIN" serve --port "$1" --redis-url "$URL" >>"$2" 2>&1 &
  echo $!
}
cleanup() {  # the fault loop restarts processes in a subshell: their pids are in files
  kill "$R1" "$(cat "$OUT/replica2.pid")" "$(cat "$OUT/redis.pid")" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap cleanup EXIT

start_redis
R1=$(start_replica "$P1" "$OUT/replica1.log"); R2=$(start_replica "$P2" "$OUT/replica2.log")
echo "$R2" >"$OUT/replica2.pid"
wait_healthy "$P1" 120; wait_healthy "$P2" 120

faults() {
  sleep $((SECONDS_TOTAL / 4)); echo "$(date +%T) fault: redis SIGKILL" >>"$OUT/faults.log"
  kill -9 "$REDIS_PID"; sleep 5; start_redis; echo "$(date +%T) redis back" >>"$OUT/faults.log"
  sleep $((SECONDS_TOTAL / 4 - 5)); echo "$(date +%T) fault: replica 2 SIGKILL" >>"$OUT/faults.log"
  kill -9 "$R2"; sleep 5; R2=$(start_replica "$P2" "$OUT/replica2.log"); echo "$R2" >"$OUT/replica2.pid"
  wait_healthy "$P2" 120
  echo "$(date +%T) replica 2 back (pid $R2)" >>"$OUT/faults.log"
  sleep $((SECONDS_TOTAL / 4 - 5)); echo "$(date +%T) fault: redis SIGKILL" >>"$OUT/faults.log"
  kill -9 "$REDIS_PID"; sleep 5; start_redis; echo "$(date +%T) redis back" >>"$OUT/faults.log"
}
faults &
"$BIN" bench-load "$TRACES" --tokenizer "$TOKENIZER" --target "127.0.0.1:$P1" --target "127.0.0.1:$P2" \
  --decoders "$DECODERS" --batch 32 --step-ms 30 --deadline-ms 20 --passes 0 --seconds "$SECONDS_TOTAL" \
  --watch-pid "$R1" --watch-pid "$R2" --watch-pid "$REDIS_PID" --timeline 60 | tee "$OUT/report.json"
wait
"$BIN" stats --target "127.0.0.1:$P1" | tee -a "$OUT/report.json"
