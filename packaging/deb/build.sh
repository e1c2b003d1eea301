#!/bin/sh
# Builds the Debian packages of the agent and the aggregator from release binaries:
#   packaging/deb/build.sh VERSION OUT_DIR [BIN_DIR (default target/release)]
# Each holds its binary, a hardened systemd unit, its config in /etc/unifed (a conffile: kept and
# merged on upgrade) and maintainer scripts that make the `unifed` system user and, once, the
# service's private key in /etc/unifed/credentials (never overwritten; removed only on purge,
# with the state folder). The scripts honour $DPKG_ROOT (dpkg --root), where they leave users
# and systemd alone. DEB_COMPRESSION (default xz) picks dpkg-deb's compressor.
set -eu
VER=$1
OUT=$2
BIN=${3:-target/release}
HERE=$(cd "$(dirname "$0")" && pwd)
ARCH=$(dpkg --print-architecture)
mkdir -p "$OUT"
for pkg in agent aggregator; do
  case $pkg in
    agent) KEY=agent-identity; WHAT="site agent: trains a federation's model on this device" ;;
    aggregator) KEY=aggregator; WHAT="aggregator: the server of a federation" ;;
  esac
  R=$(mktemp -d)
  install -D -m 0755 "$BIN/unifed-$pkg" "$R/usr/bin/unifed-$pkg"
  install -D -m 0644 "$HERE/unifed-$pkg.service" "$R/lib/systemd/system/unifed-$pkg.service"
  install -D -m 0644 "$HERE/$pkg.toml" "$R/etc/unifed/$pkg.toml"
  install -d "$R/DEBIAN"
  cat > "$R/DEBIAN/control" <<CONTROL
Package: unifed-$pkg
Version: $VER
Architecture: $ARCH
Maintainer: UniFed Edge <unifed@localhost>
Section: science
Priority: optional
Depends: libc6, adduser
Description: UniFed Edge $WHAT
 Federated learning with client-specific BatchNorm for edge imaging devices.
CONTROL
  echo "/etc/unifed/$pkg.toml" > "$R/DEBIAN/conffiles"
  cat > "$R/DEBIAN/postinst" <<SCRIPT
#!/bin/sh
set -e
ROOT="\${DPKG_ROOT:-}"
if [ "\$1" = configure ]; then
  if [ -z "\$ROOT" ]; then
    getent group unifed >/dev/null || addgroup --quiet --system unifed
    getent passwd unifed >/dev/null || adduser --quiet --system --ingroup unifed \\
      --no-create-home --home /nonexistent --shell /usr/sbin/nologin unifed
    for g in video render; do
      if getent group \$g >/dev/null; then adduser --quiet unifed \$g || true; fi
    done
  fi
  install -d -m 0700 "\$ROOT/etc/unifed/credentials"
  if [ ! -e "\$ROOT/etc/unifed/credentials/$KEY.key" ]; then
    "\$ROOT/usr/bin/unifed-$pkg" identity --key "\$ROOT/etc/unifed/credentials/$KEY.key" \\
      > "\$ROOT/etc/unifed/credentials/$KEY.pub"
    chmod 0644 "\$ROOT/etc/unifed/credentials/$KEY.pub"
    echo "unifed-$pkg: made this machine's key; its public half (to enrol or pin):"
    head -1 "\$ROOT/etc/unifed/credentials/$KEY.pub"
  fi
  if [ -z "\$ROOT" ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload || true
    systemctl try-restart unifed-$pkg.service || true
  fi
fi
SCRIPT
  cat > "$R/DEBIAN/prerm" <<SCRIPT
#!/bin/sh
set -e
if [ "\$1" = remove ] && [ -z "\${DPKG_ROOT:-}" ] && [ -d /run/systemd/system ]; then
  systemctl stop unifed-$pkg.service || true
fi
SCRIPT
  cat > "$R/DEBIAN/postrm" <<SCRIPT
#!/bin/sh
set -e
ROOT="\${DPKG_ROOT:-}"
if [ "\$1" = purge ]; then
  rm -rf "\$ROOT/var/lib/unifed-$pkg"
  rm -f "\$ROOT/etc/unifed/credentials/$KEY.key" "\$ROOT/etc/unifed/credentials/$KEY.pub"
  rmdir "\$ROOT/etc/unifed/credentials" "\$ROOT/etc/unifed" 2>/dev/null || true
fi
if [ -z "\$ROOT" ] && [ -d /run/systemd/system ]; then systemctl daemon-reload || true; fi
SCRIPT
  chmod 0755 "$R/DEBIAN/postinst" "$R/DEBIAN/prerm" "$R/DEBIAN/postrm"
  dpkg-deb --root-owner-group "-Z${DEB_COMPRESSION:-xz}" --build "$R" \
    "$OUT/unifed-${pkg}_${VER}_${ARCH}.deb" >/dev/null
  rm -rf "$R"
  echo "$OUT/unifed-${pkg}_${VER}_${ARCH}.deb"
done
