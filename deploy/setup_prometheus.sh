#!/usr/bin/env bash
# Prometheus and promtool for the monitoring tests (tests/deploy/test_monitoring.py). Where apt
# can fetch it, Debian's prometheus package is unpacked under the virtualenv, never installed
# (both are static binaries), and the folder holding `prometheus` and `promtool` is printed.
# Prints nothing where they cannot be had (then those tests skip, saying why).
#   DRAFTCACHE_TEST_PROMETHEUS="$(bash deploy/setup_prometheus.sh)" python -m pytest tests/deploy/test_monitoring.py
set -uo pipefail
cd "$(dirname "$0")/.."
VENV="${DRAFTCACHE_VENV:-.venv}"
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
DEST="$VENV/prometheus"
works() { [ -x "$DEST/bin/prometheus" ] && "$DEST/bin/prometheus" --version >/dev/null 2>&1 && "$DEST/bin/promtool" --version >/dev/null 2>&1; }
if works; then
  echo "$DEST/bin"
  exit 0
fi
command -v apt-get >/dev/null && command -v dpkg >/dev/null || exit 0
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# Downloads into $work only, from the package lists the machine has (nothing is updated).
(cd "$work" && apt-get download -q prometheus) >/dev/null 2>&1 || exit 0
rm -rf "$DEST" && mkdir -p "$DEST/bin"
for deb in "$work"/*.deb; do
  dpkg -x "$deb" "$work/root" || exit 0
done
cp "$work/root/usr/bin/prometheus" "$work/root/usr/bin/promtool" "$DEST/bin/" || exit 0
works && echo "$DEST/bin"
exit 0
