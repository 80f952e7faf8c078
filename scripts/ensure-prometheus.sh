#!/usr/bin/env bash
# The dashboard test runs a real Prometheus: install Debian's package if missing.
set -euo pipefail
command -v prometheus >/dev/null 2>&1 && exit 0
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y --no-install-recommends prometheus >/dev/null 2>&1 || {
  $SUDO apt-get update >/dev/null
  $SUDO apt-get install -y --no-install-recommends prometheus >/dev/null
}
# The package may start a system service; the test runs its own instance.
pkill -x prometheus 2>/dev/null || true
command -v prometheus
