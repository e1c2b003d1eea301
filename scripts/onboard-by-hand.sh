#!/bin/bash
# Onboarding at full size over MQTT, by hand: a broker, an aggregator with BN sharing `affine`,
# two sites training one round; then a new site (morpho) runs `calibrate --config` (package,
# calibration, sealed registration) and a second device of it runs `fetch-calibrated`.
# Usage (after cargo build --release --workspace): scripts/onboard-by-hand.sh [work dir]
set -e
B="$(cd "$(dirname "$0")/.." && pwd)/target/release"
W="${1:-run/onboard}"; rm -rf "$W"; mkdir -p "$W"; cd "$W"
$B/unifed-broker --listen 127.0.0.1:18830 > broker.log 2>&1 &
BP=$!
sleep 1
$B/unifed-agent init --out init.safetensors
# Identities: each party makes its key on its own machine and hands over only the public key
# (first line of `identity`'s output); the coordinator enrols the sites, the sites pin the
# aggregator.
AGG_KEY=$($B/unifed-aggregator identity --key aggregator.key | head -1)
SITES=""
for s in grey texture morpho; do
  SITES="$SITES{ id = \"$s\", key = \"$($B/unifed-agent identity --key $s.id | head -1)\" }, "
done
cat > agg.toml <<T
data_dir = "agg"
model = "init.safetensors"
key = "aggregator.key"
linger_secs = 3600
[broker]
host = "127.0.0.1"
port = 18830
max_packet_bytes = 1048576
[federation]
federation = "demo"
rounds = 1
min_sites = 2
deadline_secs = 900
fraction = 1.0
sites = [$SITES]
encoding = "f32"
bn_policy = "local"
bn_sharing = "affine"
weighting = "samples"
keep_versions = 3
max_update_bytes = 268435456
seed = 0
T
$B/unifed-aggregator serve --config agg.toml > agg.log 2>&1 &
AP=$!
for s in grey texture; do
cat > $s.toml <<T
site = "$s"
federation = "demo"
state_dir = "$s"
threads = 1
identity = "$s.id"
aggregator_key = "$AGG_KEY"
[broker]
host = "127.0.0.1"
port = 18830
max_packet_bytes = 1048576
[data]
builtin = "$s"
train_samples = 743
T
$B/unifed-agent train --config $s.toml > $s.log 2>&1 &
done
wait %3 %4 || true
$B/unifed-agent keygen --out morpho.key
for d in morpho morpho-b; do
cat > $d.toml <<T
site = "morpho"
federation = "demo"
state_dir = "$d"
site_key = "morpho.key"
identity = "morpho.id"
aggregator_key = "$AGG_KEY"
[broker]
host = "127.0.0.1"
port = 18830
max_packet_bytes = 1048576
[data]
builtin = "morpho"
T
done
T=""; [ -x /usr/bin/time ] && T="/usr/bin/time -v"
$T $B/unifed-agent calibrate --config morpho.toml > cal.out 2> cal.err
$T $B/unifed-agent fetch-calibrated --config morpho-b.toml > fetch.out 2> fetch.err
cmp morpho/calibrated/v1.safetensors morpho-b/calibrated/v1.safetensors && echo IDENTICAL
ls -la agg/registry/morpho/ agg/models/
kill $AP $BP
cat cal.out fetch.out
