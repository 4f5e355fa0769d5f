#!/usr/bin/env bash
# draftcache inside real engines, measured by the engines themselves: per engine (vLLM on CPU,
# llama.cpp through llama-cpp-python), plain greedy decoding, the engine's own model-free
# methods (vLLM: ngram, suffix; llama.cpp: LlamaPromptLookupDecoding) and draftcache, on
# Spec-Bench first turns and a repeated agent workload, interleaved; on request also llama.cpp's
# own server (llama-server) with its own model-free methods, which takes no outside drafter.
# Prints one JSON line per engine x workload x method (benchmarks/engines_bench.py says what each
# key means).
#   bash deploy/bench_engines.sh            # 3 Spec-Bench prompts per group, 4 agent tasks x 2 passes, 128 tokens
#   bash deploy/bench_engines.sh --quick    # 1 per group, 2 agent tasks x 2 passes (shorter prompts), 64 tokens
#   bash deploy/bench_engines.sh --engines vllm     # one engine only (vllm, llama.cpp, llama-server)
#   bash deploy/bench_engines.sh --engines vllm,llama.cpp,llama-server  # also llama.cpp's own server
#                                                   # with its own model-free methods (ngram-mod, its
#                                                   # default, ngram-simple, ngram-map-k), no draftcache
#                                                   # in it: it has no hook for an outside drafter
#                                                   # (deploy/setup_llama_server.sh builds it, once)
#   bash deploy/bench_engines.sh --cold             # the service with an empty memory and no static prior
#   bash deploy/bench_engines.sh --vllm-dtype auto  # vLLM's dtype (default: float32; auto: bfloat16
#                                                   # where the CPU has bf16 instructions; see below)
#   bash deploy/bench_engines.sh --vllm-draft-model smollm2  # also vLLM's draft-model method with this
#                                                   # model (a folder with SmolLM2's tokenizer) and
#                                                   # draftcache beside it (draftcache-beside)
#   bash deploy/bench_engines.sh --llama-draft-model smollm2  # llama.cpp: also draftcache beside this
#                                                   # GGUF (SmolLM2's tokenizer) in a Llama of its own
#                                                   # (draftcache-beside)
#   bash deploy/bench_engines.sh --vllm-methods draftcache  # vLLM: these methods only, and plain (each
#                                                   # engine holds 2-3 GB here: six at once need more)
#   bash deploy/bench_engines.sh --vllm-batch 6     # vLLM: prompts 6 at a time, as concurrent requests
#                                                   # (never both agent passes in one batch)
#   bash deploy/bench_engines.sh --llama-threads 0  # llama.cpp and llama-server: their own thread
#                                                   # defaults (a batch, a verification too, on every
#                                                   # core) instead of one thread for all (the default,
#                                                   # which leaves a core to the service)
#
# Sets up what it needs on a fresh machine: .venv (the service, the prompts and llama.cpp),
# .venv-vllm (deploy/setup_vllm.sh) with arctic-inference for vLLM's suffix method, the SmolLM2
# model folder, and for each engine a fresh `draftcache serve` on its embedded Redis (an empty
# lifetime memory), stopped on exit. As a deployment is warmed (deploy/quickstart.sh does the
# same), the service gets a static prior for SmolLM2's tokenizer warmed from the ShareGPT corpus
# (ChatGPT's answers: none of the benchmark's prompts or SmolLM2's outputs; warmed once, about
# 90 s, kept in data/). draftcache drafts near, as it does by default (the prior, read from the
# service, and the fleet's history in the engine's process: no round trip a step); except with
# --quick, each engine also runs draftcache-service, drafting through the service at every step
# (near=false). --cold leaves the prior out. An engine, or a method, that cannot be set up is
# reported as a JSON line with a "skipped" reason and the others run. Logs, the prompts and the lines
# (results.jsonl) are kept in data/bench-engines/. vLLM runs in float32 unless told otherwise: in
# bfloat16 a batched verification rounds differently from a one-token step, so every drafting
# method's output, vLLM's own ngram and suffix too, leaves plain greedy's at near ties (about half
# the prompts). Then the run can show no method lossless, and the methods decode different texts
# of different lengths, so their rates over whole requests compare unequal work. In float32 every
# method's output stays plain greedy's on every prompt. --vllm-dtype auto (bfloat16 where the CPU
# has bf16 instructions, else float32) or bfloat16 measures the faster dtype.
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=0
PRIOR_ON=1
ENGINES="vllm,llama.cpp"
VLLM_DTYPE=float32
VLLM_DRAFT_MODEL=""
LLAMA_DRAFT_MODEL=""
VLLM_METHODS=""
VLLM_BATCH=1
LLAMA_THREADS=1
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1 ;;
    --prior) PRIOR_ON=1 ;;  # the default; kept for the command lines that name it
    --cold) PRIOR_ON=0 ;;
    --engines) ENGINES="$2"; shift ;;
    --vllm-dtype) VLLM_DTYPE="$2"; shift ;;
    --vllm-draft-model) VLLM_DRAFT_MODEL="$2"; shift ;;
    --llama-draft-model) LLAMA_DRAFT_MODEL="$2"; shift ;;
    --vllm-methods) VLLM_METHODS="$2"; shift ;;
    --vllm-batch) VLLM_BATCH="$2"; shift ;;
    --llama-threads) LLAMA_THREADS="$2"; shift ;;
    *) echo "usage: bash deploy/bench_engines.sh [--quick] [--cold] [--engines vllm,llama.cpp,llama-server] [--vllm-dtype auto|float32|bfloat16] [--vllm-draft-model DIR|smollm2] [--llama-draft-model GGUF|smollm2] [--vllm-methods ngram,suffix,draftcache] [--vllm-batch N] [--llama-threads N]" >&2; exit 2 ;;
  esac
  shift
done
if [ "$QUICK" = 1 ]; then  # an agent task's user turn cut to 450 tokens (~600 with the system turn)
  PER_GROUP=1 AGENT_TASKS=2 AGENT_TOKENS=450 MAX_NEW_TOKENS=64
else
  PER_GROUP=3 AGENT_TASKS=4 AGENT_TOKENS=1500 MAX_NEW_TOKENS=128
fi
START=$(date +%s)
export DRAFTCACHE_SHARED="${DRAFTCACHE_SHARED:-$(cd .. && pwd)/shared}"
OUT="${DRAFTCACHE_BENCH_DIR:-data/bench-engines}"
rm -rf "$OUT"
mkdir -p "$OUT"
RESULTS="$OUT/results.jsonl"
LLAMA_CPP_PYTHON="llama-cpp-python==0.3.36"

note() {  # $1 engine, $2 reason: a line saying the engine was not measured
  python -c 'import json, sys; print(json.dumps({"engine": sys.argv[1], "workload": None, "method": None,
    "tokens_per_s": None, "mean_accepted_tokens": None, "identical_to_greedy": None, "skipped": sys.argv[2]}))' \
    "$1" "$2" | tee -a "$RESULTS"
}

echo "== setting up (a fresh machine builds llama.cpp and installs vLLM: many minutes, once)" >&2
# shellcheck disable=SC1091
source deploy/setup_env.sh
source deploy/bench_common.sh
LLAMA_OK=1
if [[ ",$ENGINES," == *",llama.cpp,"* ]] && ! python -c "import llama_cpp" 2>/dev/null; then
  # The project's llamacpp extra where it has one, else the version the draft model is tested on.
  if grep -q '^llamacpp *=' pyproject.toml; then WANT=(-e ".[llamacpp]"); else WANT=("$LLAMA_CPP_PYTHON"); fi
  CMAKE_ARGS="${CMAKE_ARGS:-$LLAMA_CMAKE_ARGS}" pip install -q "${WANT[@]}" >"$OUT/setup-llama-cpp.log" 2>&1 || LLAMA_OK=0
fi
SERVER_OK=1
if [[ ",$ENGINES," == *",llama-server,"* ]]; then
  bash deploy/setup_llama_server.sh >"$OUT/setup-llama-server.log" 2>&1 || SERVER_OK=0
fi
VLLM_OK=1
if [[ ",$ENGINES," == *",vllm,"* ]]; then
  bash deploy/setup_vllm.sh >"$OUT/setup-vllm.log" 2>&1 || VLLM_OK=0
  if [ "$VLLM_OK" = 1 ]; then
    # Without it vLLM's suffix method is reported as skipped, and the rest runs.
    bash deploy/setup_suffix_decoding.sh >"$OUT/setup-suffix.log" 2>&1 || true
    .venv-vllm/bin/python -c "from decoder_client.models import smollm2_hf_folder; smollm2_hf_folder()" \
      >"$OUT/model-folder.log" 2>&1 || VLLM_OK=0
  fi
fi
PRIOR="data/prior-smollm2.npz"  # the namespace's static prior: warmed once, then kept
TOKENIZER="$DRAFTCACHE_SHARED/data/tokenizers/smollm2"
if [ "$PRIOR_ON" = 1 ] && [ ! -f "$PRIOR" ]; then
  mkdir -p data
  echo "== warming SmolLM2's static prior from ShareGPT (once: about a minute and a half)" >&2
  draftcache warm --namespace smollm2 --tokenizer "$TOKENIZER" \
    --corpus "$DRAFTCACHE_SHARED/data/corpora/sharegpt_v3_17671.json.gz" --format sharegpt --out "$PRIOR" \
    >"$OUT/warm-prior.log" 2>&1 || { echo "warming the prior failed: see $OUT/warm-prior.log" >&2; exit 1; }
fi
python -m benchmarks.engine_workloads --out "$OUT/prompts.json" --per-group "$PER_GROUP" --agent-tasks "$AGENT_TASKS" \
  --max-user-tokens "$AGENT_TOKENS" >&2

SERVER=""
DRIVER=""
stop_service() {
  if [ -n "$SERVER" ]; then
    kill -TERM "$SERVER" 2>/dev/null || true
    wait "$SERVER" 2>/dev/null || true
    SERVER=""
  fi
}
cleanup() {
  if [ -n "$DRIVER" ]; then  # the driver runs in a process group of its own: its engines go with it
    kill -TERM -- "-$DRIVER" 2>/dev/null || true
    for _ in $(seq 20); do kill -0 -- "-$DRIVER" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$DRIVER" 2>/dev/null || true  # vLLM's engine processes can outlive a TERM
    wait "$DRIVER" 2>/dev/null || true
  fi
  stop_service
}
trap cleanup EXIT
trap 'exit 130' INT TERM
PORT=""
start_service() {  # $1: the service's data folder, emptied first
  rm -rf "$1"
  PORT=$(port)
  draftcache serve --port "$PORT" --data-dir "$1" >"$1.log" 2>&1 &
  SERVER=$!
  wait_healthy "$PORT"
  if [ "$PRIOR_ON" = 1 ]; then  # published into its storage, then loaded (and read by the near copies)
    for ns in smollm2 smollm2-service ${VLLM_DRAFT_MODEL:+smollm2-beside} ${LLAMA_DRAFT_MODEL:+smollm2-beside}; do
      draftcache warm --namespace "$ns" --tokenizer "$TOKENIZER" --from-prior "$PRIOR" --data-dir "$1" >>"$1.log" 2>&1
      draftcache rebuild --target "127.0.0.1:$PORT" --namespace "$ns" >>"$1.log" 2>&1
    done
  fi
}

run_engine() {  # $1 engine, $2 its python
  start_service "$OUT/service-$1"
  EXTRA=()
  CACHE="${NUMBA_CACHE_DIR:-}"
  if [ "$1" = vllm ]; then
    # The compiled drafting loops of vLLM's virtualenv (another numba than .venv's) cached apart.
    CACHE="${NUMBA_CACHE_DIR:-$(pwd)/.venv-vllm/numba-cache}"
    EXTRA=(--dtype "$VLLM_DTYPE")
    if [ -n "$VLLM_DRAFT_MODEL" ]; then EXTRA+=(--draft-model "$VLLM_DRAFT_MODEL"); fi
    if [ -n "$VLLM_METHODS" ]; then EXTRA+=(--methods "$VLLM_METHODS"); fi
    EXTRA+=(--batch "$VLLM_BATCH")
  fi
  if [ "$1" = llama.cpp ] && [ -n "$LLAMA_DRAFT_MODEL" ]; then EXTRA+=(--llama-draft-model "$LLAMA_DRAFT_MODEL"); fi
  if [ "$1" = llama.cpp ]; then EXTRA+=(--llama-threads "$LLAMA_THREADS"); fi
  if [ "$QUICK" = 0 ]; then  # also drafting through the service at every step
    EXTRA+=(--variant "service:near=false")
  fi
  NUMBA_CACHE_DIR="$CACHE" setsid -w "$2" -m benchmarks.engines_bench --engine "$1" --workloads "$OUT/prompts.json" \
    --target "127.0.0.1:$PORT" --max-new-tokens "$MAX_NEW_TOKENS" --work-dir "$OUT" --out "$RESULTS" \
    "${EXTRA[@]}" 2>"$OUT/driver-$1.log" &
  DRIVER=$!
  wait "$DRIVER" || note "$1" "the benchmark failed (exit $?): see $OUT/driver-$1.log"
  DRIVER=""
  stop_service
}

for engine in ${ENGINES//,/ }; do
  case "$engine" in
    vllm)
      if [ "$VLLM_OK" = 1 ]; then
        echo "== vLLM: plain, ngram, suffix, draftcache (each engine's first start takes a few minutes)" >&2
        run_engine vllm .venv-vllm/bin/python
      else
        note vllm "vLLM could not be set up: see $OUT/setup-vllm.log and $OUT/model-folder.log"
      fi ;;
    llama.cpp)
      if [ "$LLAMA_OK" = 1 ]; then
        echo "== llama.cpp: plain, prompt lookup, draftcache" >&2
        run_engine llama.cpp python
      else
        note llama.cpp "$LLAMA_CPP_PYTHON could not be installed: see $OUT/setup-llama-cpp.log"
      fi ;;
    llama-server)  # no draftcache in it, so no service
      if [ "$SERVER_OK" = 1 ]; then
        echo "== llama-server: plain, its own n-gram methods" >&2
        setsid -w python -m benchmarks.engines_bench --engine llama-server --workloads "$OUT/prompts.json" \
          --max-new-tokens "$MAX_NEW_TOKENS" --work-dir "$OUT" --out "$RESULTS" --llama-threads "$LLAMA_THREADS" \
          2>"$OUT/driver-llama-server.log" &
        DRIVER=$!
        wait "$DRIVER" || note llama-server "the benchmark failed (exit $?): see $OUT/driver-llama-server.log"
        DRIVER=""
      else
        note llama-server "llama-server could not be built: see $OUT/setup-llama-server.log"
      fi ;;
    *) note "$engine" "unknown engine (known: vllm, llama.cpp, llama-server)" ;;
  esac
done
echo "== done in $(( $(date +%s) - START )) s; the lines are in $RESULTS" >&2
