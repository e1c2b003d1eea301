#!/usr/bin/env bash
# Installs the Debian `mosquitto` package (broker and mosquitto_passwd) when it is missing, so the
# end-to-end tests also run against Mosquitto. The tests write their own broker config (see
# `tests/src/fed.rs`, `mosquitto_conf`): loopback listener, password file, packet limit,
# max_queued_messages, no persistence. The package's own system service is not needed.
set -euo pipefail
if command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ]; then
    echo "mosquitto: already installed ($(/usr/sbin/mosquitto -h 2>/dev/null | head -1 || true))"
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
        echo "install-mosquitto: not root and no sudo; install the mosquitto package by hand" >&2
        exit 1
    fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends mosquitto
# Debian starts a system broker on port 1883; the tests do not use it, and a hospital site
# configures its own (configs/mosquitto.conf).
$SUDO systemctl disable --now mosquitto >/dev/null 2>&1 || true
