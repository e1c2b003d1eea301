#!/bin/bash
# The demo federation with five agents on one GPU (issue 18, goal 1), for a lent GPU machine.
#
# Prepare on the dev machine, in the ignored folder target/gpu, then carry it (run's `carry`):
#   cargo build --release -p unifed-demo --features vulkan
#   strip -o /tmp/ud target/release/unifed-demo && xz -T2 -4 -c /tmp/ud > target/gpu/unifed-demo.xz
#   target/gpu/debs/*.deb: Debian's libvulkan1 and the libglvnd set (results/gpu/README.md)
#   target/gpu/seed.db (optional): an autotune database of an earlier run on the same card
#   target/gpu/kernels.tar.gz (optional): kernel caches this script kept last time
# Run from the repository root: bash scripts/gpu-demo.sh [ROUNDS]. Everything it measures goes
# into one archive, $OUT/gpu-demo.tar.gz (a device returns a limited count of files), with the
# tuned kernel caches, so that the next session's machine need not tune again.
set -u
ROUNDS=${1:-3}
G=target/gpu
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
t() { echo "== $(el) s: $*"; }
R=/tmp/gpu-demo; W=/tmp/gpu-demo-work; mkdir -p $R
trap 'tar -czf $OUT/gpu-demo.tar.gz -C $R . -C $W kernels 2>/dev/null; t done' EXIT
for d in $G/debs/*.deb; do dpkg -x "$d" / ; done; ldconfig
xz -dc $G/unifed-demo.xz > /tmp/ud && chmod +x /tmp/ud
export UNIFED_ASSETS=$PWD/assets
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)"; } | tee $R/machine.txt
if [ -f $G/kernels.tar.gz ]; then mkdir -p $W && tar -xzf $G/kernels.tar.gz -C $W
elif [ -f $G/seed.db ]; then
  for s in grey texture lowres fonts noisy; do mkdir -p $W/kernels/$s; cp $G/seed.db $W/kernels/$s/default.db; done
fi
run() { # name, timeout, demo arguments...
  local name=$1 limit=$2; shift 2
  t "$name: unifed-demo $*"
  timeout $limit /tmp/ud "$@" --work $W --out $R/$name > $R/$name.txt 2>&1; echo "rc $?" | tee -a $R/$name.txt
  tail -45 $R/$name.txt
  for p in local global; do [ -d $W/$p ] && mkdir -p $R/$name-logs && for f in $W/$p/*.log; do tail -c 20000 $f > $R/$name-logs/$p-$(basename $f); done; done
}
run tune 300 --backend vulkan --rounds 1 --policies local
run vulkan $(( 520 - $(el) )) --backend vulkan --rounds $ROUNDS
