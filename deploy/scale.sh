#!/usr/bin/env bash
# Scale-out on one host: memory per server process and drafting throughput, 1 -> N processes.
#
#   bash deploy/scale.sh [max_processes=2] [seconds=30] [corpus=../shared/data/corpora/sharegpt_v3_17671.json.gz]
#
# Redis runs on loopback and the llama2 namespace's lifetime log is filled from a corpus
# (`draftcache warm --lifetime`). Then, for N = 1 .. max_processes:
#   shared:      `draftcache serve --processes N`: one worker builds the lifetime indexes from the
#                log, every worker maps them;
#   independent: N plain `draftcache serve` processes on one Redis, each building its own copy
#                (the layout before shared indexes), measured for N >= 2 as the baseline.
# Each layout's processes are measured once serving (RSS; PSS, which splits shared pages between
# the processes mapping them; USS, the pages only that process holds), then `draftcache
# bench-load` drives them (4 decoder processes, batch 32, back to back, finished requests
# committed, so rebuilds run as under real traffic) for the given seconds, sampling the servers' CPU.
# The JSON lines land in scale/report.jsonl, the processes' logs and data directories (each
# process's commit journal is its own) beside them. Paths given as arguments or in OUT,
# TOKENIZER, TRACES and DRAFTCACHE_SHARED are read from the directory the script is started in.
set -euo pipefail
# shellcheck source=deploy/bench_common.sh
source "$(dirname "$0")/bench_common.sh"
MAX=${1:-2}
SECONDS_EACH=${2:-30}
CORPUS=$(from_caller "${3:-$SHARED/data/corpora/sharegpt_v3_17671.json.gz}")
TOKENIZER=$(from_caller "${TOKENIZER:-$SHARED/data/tokenizers/llama2-spm}")
TRACES=$(from_caller "${TRACES:-$SHARED/data/traces/spec_bench_vicuna7b.jsonl.gz}")
OUT=$(from_caller "${OUT:-$ROOT/scale}")
BIN=${DRAFTCACHE:-draftcache}
cd "$ROOT"
rm -rf "$OUT"; mkdir -p "$OUT/redis"
REDIS_PORT=$(port)
REDIS_BIN=$(python -c 'from cache_service.host.embedded_redis import find_server_binary; print(find_server_binary())')
URL="redis://127.0.0.1:$REDIS_PORT/0"
"$REDIS_BIN" --bind 127.0.0.1 --port "$REDIS_PORT" --dir "$OUT/redis" --save "" >"$OUT/redis.log" 2>&1 &
REDIS_PID=$!
PIDS=()
cleanup() { kill "${PIDS[@]}" "$REDIS_PID" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT
for _ in $(seq 100); do python -c "import redis; redis.Redis.from_url('$URL').ping()" 2>/dev/null && break; sleep 0.1; done

"$BIN" warm --lifetime --namespace llama2 --tokenizer "$TOKENIZER" --corpus "$CORPUS" --redis-url "$URL"
# Every layout starts from the same log: the load commits requests, which a later layout would
# otherwise find in its memory (longer drafts, a different workload).
keep_log() {  # $1: save | restore
  python - "$URL" "$1" <<'EOF'
import sys, redis
from cache_service.storage import keys
r = redis.Redis.from_url(sys.argv[1])
for key in (keys.log("llama2"), keys.log_tokens("llama2")):
    src, dst = (key, key + ":saved") if sys.argv[2] == "save" else (key + ":saved", key)
    r.copy(src, dst, replace=True)
EOF
}
keep_log save

wait_listeners() {  # $1: port, $2: how many processes must be listening on it (SO_REUSEPORT)
  python - "$1" "$2" <<'EOF'
import sys, time
from pathlib import Path
port, want = int(sys.argv[1]), int(sys.argv[2])
for _ in range(3000):
    rows = [line.split() for f in ("/proc/net/tcp", "/proc/net/tcp6") for line in Path(f).read_text().splitlines()[1:]]
    if sum(1 for r in rows if r[3] == "0A" and int(r[1].rsplit(":", 1)[1], 16) == port) >= want:
        sys.exit(0)
    time.sleep(0.1)
sys.exit("not every worker listens")
EOF
}
memory() {  # $1: layout, $2: N, then the serving pids: one JSON line
  python - "$@" <<'EOF'
import json, sys
from pathlib import Path
layout, n, pids = sys.argv[1], int(sys.argv[2]), [int(p) for p in sys.argv[3:]]
rows = []
for pid in pids:
    kb = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        kb[key] = int(value.split()[0])
    uss = kb["Private_Clean"] + kb["Private_Dirty"]
    rows.append({"pid": pid, "rss_mb": kb["Rss"] // 1024, "pss_mb": kb["Pss"] // 1024, "uss_mb": uss // 1024})
print(json.dumps({"layout": layout, "processes": n, "memory": rows, "pss_total_mb": sum(r["pss_mb"] for r in rows)}))
EOF
}
workers_of() {  # the supervisor's worker processes
  python - "$1" <<'EOF'
import sys
from pathlib import Path
sup = int(sys.argv[1])
for e in Path("/proc").iterdir():
    if e.name.isdigit():
        try:
            ppid = int((e / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (e / "cmdline").read_bytes()
        except OSError:
            continue
        if ppid == sup and b"spawn_main" in cmd:
            print(e.name)
EOF
}
load() {  # $1: label, $2: serving pids (comma-separated), then targets
  local label=$1 pids=$2; shift 2
  local args=()
  for t in "$@"; do args+=(--target "$t"); done
  for p in ${pids//,/ }; do args+=(--watch-pid "$p"); done
  # A long deadline: this measures what the servers deliver, not the clients' fallback.
  "$BIN" bench-load "$TRACES" --tokenizer "$TOKENIZER" "${args[@]}" --decoders 4 --batch 32 \
    --deadline-ms 1000 --seconds "$SECONDS_EACH" --passes 0 >"$OUT/load-$label.json"
  python - "$OUT/load-$label.json" "$label" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
keys = ("sequence_drafts_per_s", "fallback_share", "step_ms_p50", "step_ms_p99", "mat")
cpu = {pid: p["cpu_cores_used"] for pid, p in r.get("processes", {}).items()}
print(json.dumps({"load": sys.argv[2], **{k: r[k] for k in keys}, "server_cpu_cores": cpu}))
EOF
}

for N in $(seq 1 "$MAX"); do
  keep_log restore
  P=$(port)
  "$BIN" serve --processes "$N" --port "$P" --redis-url "$URL" --data-dir "$OUT/shared-$N" >"$OUT/shared-$N.log" 2>&1 &
  SUP=$!; PIDS+=("$SUP")
  wait_healthy "$P"
  wait_listeners "$P" "$N"  # each worker listens once it has restored (mapped the indexes)
  mapfile -t W < <(if [ "$N" -gt 1 ]; then workers_of "$SUP"; else echo "$SUP"; fi)
  LAYOUT=$([ "$N" -gt 1 ] && echo shared || echo one)  # one process serves alone, nothing to share
  memory "$LAYOUT" "$N" "${W[@]}" | tee -a "$OUT/report.jsonl"
  load "$LAYOUT-$N" "$(IFS=,; echo "${W[*]}")" "127.0.0.1:$P" | tee -a "$OUT/report.jsonl"
  kill "$SUP"; wait "$SUP" || true
  if [ "$N" -gt 1 ]; then
    keep_log restore
    TARGETS=(); SOLO=()
    for i in $(seq 1 "$N"); do
      Q=$(port)
      "$BIN" serve --port "$Q" --redis-url "$URL" --data-dir "$OUT/independent-$N-$i" \
        >"$OUT/independent-$N-$i.log" 2>&1 &
      SOLO+=($!); PIDS+=($!); TARGETS+=("127.0.0.1:$Q")
    done
    for t in "${TARGETS[@]}"; do wait_healthy "${t##*:}"; done
    memory independent "$N" "${SOLO[@]}" | tee -a "$OUT/report.jsonl"
    load "independent-$N" "$(IFS=,; echo "${SOLO[*]}")" "${TARGETS[@]}" | tee -a "$OUT/report.jsonl"
    kill "${SOLO[@]}"; wait "${SOLO[@]}" || true
  fi
done
