# shellcheck shell=bash
# Shared by the benchmark scripts beside this file. Sourced before they change to the project
# root, so that a path the caller gives (an argument, OUT, TOKENIZER, TRACES, DRAFTCACHE_SHARED)
# is read from where the script was started, and the defaults from the project's own places.

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

from_caller() {  # $1: a path as the caller gave it; absolute, from the directory the script started in
  case "$1" in
    /*) printf '%s\n' "$1" ;;
    *) printf '%s\n' "$PWD/$1" ;;
  esac
}

# shellcheck disable=SC2034  # read by the scripts that source this file
SHARED=$(from_caller "${DRAFTCACHE_SHARED:-$ROOT/../shared}")  # traces, corpora, tokenizers under data/

port() {  # a free loopback port
  python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

wait_healthy() {  # $1: port, $2: tries half a second apart (600); deploy/healthcheck.py exits 0 once it answers SERVING
  for _ in $(seq "${2:-600}"); do python "$ROOT/deploy/healthcheck.py" "127.0.0.1:$1" >/dev/null 2>&1 && return; sleep 0.5; done
  echo "the service on port $1 did not become healthy" >&2; exit 1
}
