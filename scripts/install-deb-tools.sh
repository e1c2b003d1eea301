#!/usr/bin/env bash
# Installs what the package test needs when it is missing: dpkg (dpkg-deb) and systemd's
# `systemd-analyze`, with apt-get. Exits non-zero when they cannot be had (the test then skips).
set -euo pipefail
if command -v dpkg-deb >/dev/null 2>&1 && command -v systemd-analyze >/dev/null 2>&1; then
    echo "dpkg-deb and systemd-analyze: already installed"
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
        echo "install-deb-tools: not root and no sudo; install dpkg and systemd by hand" >&2
        exit 1
    fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends dpkg systemd
