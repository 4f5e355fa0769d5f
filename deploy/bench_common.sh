# Shared by the benchmark scripts beside this file (sourced from the project root).

port() {  # a free loopback port
  python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

wait_healthy() {  # $1: port, $2: tries half a second apart (600); deploy/healthcheck.py exits 0 once it answers SERVING
  for _ in $(seq "${2:-600}"); do python deploy/healthcheck.py "127.0.0.1:$1" >/dev/null 2>&1 && return; sleep 0.5; done
  echo "the service on port $1 did not become healthy" >&2; exit 1
}
