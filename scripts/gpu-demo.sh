#!/bin/bash
# Issue 18's GPU figures in one run on a lent GPU machine: the demo federation with five agents
# on one GPU (goal 1's timeline), burn-flex's thread scaling on the machine's CPU (goal 5) and
# burn on Vulkan against PyTorch CUDA (goal 4).
#
# Prepare on the dev machine, in the ignored folder target/gpu, then carry it (run's `carry`):
#   cargo build --release -p unifed-demo -p unifed-agent --features vulkan
#   for b in demo agent; do strip -o /tmp/u target/release/unifed-$b && xz -T2 -6 -c /tmp/u > target/gpu/unifed-$b.xz; done
#   target/gpu/debs/*.deb: Debian's libvulkan1 and the libglvnd set (results/gpu/README.md)
#   target/gpu/kernels.tar.gz (optional): the kernel caches this script kept last time
# Run from the repository root: bash scripts/gpu-demo.sh [ROUNDS] [SECONDS] [STEPS] [POLICIES];
# DEMO_ARGS adds options to the demo (e.g. DEMO_ARGS="--evaluate-at before-training").
# STEPS (default "warmup restart demo flex-threads vulkan") picks the steps, POLICIES the demo's BN
# policies (default both); a step starts with what is left of SECONDS (default 540). Everything
# it measures goes into one archive, $OUT/gpu-demo.tar.gz (a device returns a limited count of
# files), and the tuned kernel caches into $OUT/kernels.tar.gz, so that the next session's
# machine need not tune again.
#
# Tuning happens once, in one process: `unifed-agent warmup` trains and evaluates the first
# site on a throwaway model, filling its kernel cache (and the driver's shader cache, where the
# driver keeps one: the H200 machine of 2026-11-27 did not); the other sites' caches are copies
# of it (every site runs the same model with the same batch shapes). Five processes tuning at
# once took over four minutes on the H200 machine (results/gpu).
set -u
ROUNDS=${1:-5}
BUDGET=${2:-540}
STEPS=${3:-warmup restart demo flex-threads vulkan}
POLICIES=${4:-local,global}
on() { [[ " $STEPS " == *" $1 "* ]]; }
G=target/gpu
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
t() { echo "== $(el) s: $*"; }
left() { echo $(( BUDGET - $(el) )); }
R=/tmp/gpu-demo; W=/tmp/gpu-demo-work; mkdir -p $R $W
trap 'tar -czf $OUT/gpu-demo.tar.gz -C $R . 2>/dev/null; tar -czf $OUT/kernels.tar.gz -C $W kernels 2>/dev/null; t done' EXIT
for d in $G/debs/*.deb; do dpkg -x "$d" / ; done; ldconfig
for b in demo agent; do xz -dc $G/unifed-$b.xz > /tmp/u$b && chmod +x /tmp/u$b; done
export UNIFED_ASSETS=$PWD/assets
# The driver's compiled pipelines, kept with the kernel caches (and not trimmed to its default size).
export __GL_SHADER_DISK_CACHE_PATH=$W/kernels/nvidia __GL_SHADER_DISK_CACHE_SKIP_CLEANUP=1
mkdir -p $__GL_SHADER_DISK_CACHE_PATH
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)"; git log -1 --format=%H; } | tee $R/machine.txt
[ -f $G/kernels.tar.gz ] && tar -xzf $G/kernels.tar.gz -C $W
SITES="grey texture lowres fonts noisy"

if on warmup; then
t "warmup: one site's training and evaluation, twice (the first tunes)"
# The warm-up connects to nothing: the broker and the aggregator's key are any valid ones.
sed -e "s#@W@#$W#g" > $W/warm.toml <<'EOF'
site = "grey"
federation = "warmup"
state_dir = "@W@/warm"
kernel_cache = "@W@/kernels/grey"
backend = "vulkan"
resend_secs = 120
threads = 3
evaluate_each_model = true
identity = "@W@/warm/identity.key"
aggregator_key = "ed25519:ec8c7bf8430d792959d1117329beb5d2e691ee33c4217b737d65c23a0e9b8c36"
[train]
batch_size = 32
epochs = 1
seed = 0
[broker]
host = "127.0.0.1"
port = 1883
[data]
builtin = "grey"
train_samples = 743
EOF
timeout $(( $(left) - 60 )) /tmp/uagent warmup --config $W/warm.toml --passes 2 > $R/warmup.json 2> $R/warmup.err
echo "rc $?"; cat $R/warmup.json; tail -5 $R/warmup.err
for s in $SITES; do [ $s = grey ] || { rm -rf $W/kernels/$s; cp -r $W/kernels/grey $W/kernels/$s; }; done
fi
du -sh $W/kernels/* $W/kernels/grey/* ~/.cache/nvidia 2>&1 | tee $R/kernels-size.txt

if on restart; then
# What a restart pays with every kernel tuned: its first pass with the compiled kernels (cubecl's
# SPIR-V and the driver's pipelines, `UNIFED_KERNEL_COMPILE_CACHE`) off, then on; the driver's
# own disk cache off in both, as a service without a home folder has it.
t "restart: one pass in a fresh process, compiled kernels off then on"
for mode in off on; do
  __GL_SHADER_DISK_CACHE=0 UNIFED_KERNEL_COMPILE_CACHE=$mode timeout 150 /tmp/uagent warmup \
    --config $W/warm.toml --passes 1 > $R/restart-$mode.json 2> $R/restart-$mode.err
  echo "$mode: rc $?"; cat $R/restart-$mode.json
done
fi

run() { # name, timeout, command...
  local name=$1 limit=$2; shift 2
  on $name || return
  [ $limit -gt 20 ] || { t "$name: skipped, $limit s left"; return; }
  t "$name (at most $limit s): $*"
  timeout $limit "$@" > $R/$name.txt 2>&1; echo "rc $?" | tee -a $R/$name.txt
  tail -60 $R/$name.txt
}
# Room for the benches after the demo, when they run.
later=10; { on flex-threads || on vulkan; } && later=150
run demo $(( $(left) - later )) /tmp/udemo --backend vulkan --rounds $ROUNDS --policies $POLICIES --work $W --out $R/demo ${DEMO_ARGS:-}
for p in local global; do [ -d $W/$p ] && mkdir -p $R/demo-logs && for f in $W/$p/*.log; do tail -c 20000 $f > $R/demo-logs/$p-$(basename $f); done; done
run flex-threads $(( $(left) - 60 )) /tmp/uagent bench --backends flex --thread-counts 2,8,16 --steps 20 \
  --torch-script scripts/torch_bench.py --out $R/bench-flex.json
run vulkan $(left) /tmp/uagent --backend vulkan --kernel-cache $W/kernels/grey bench --backends vulkan \
  --torch-device cuda --torch-script scripts/torch_bench.py --out $R/bench-vulkan.json
