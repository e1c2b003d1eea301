#!/usr/bin/env bash
# The experiment runner's seconds per round against plain PyTorch doing the same round
# (scripts/torch_round.py: five sites train one epoch, the server averages, every site
# evaluates) on the same cores. Writes results/runner-speed.{json,md}.
#   ./scripts/runner_speed.sh [threads]        (default 2; needs .venv with torch, numpy and
#                                               safetensors: .venv/bin/pip install torch numpy safetensors)
set -euo pipefail
cd "$(dirname "$0")/.."
threads="${1:-2}"
py="${UNIFED_TORCH_PYTHON:-.venv/bin/python}"
cargo build --release -p unifed-sim
out="$(mktemp -d)"
./target/release/unifed-sim --threads "$threads" experiment configs/experiments/speed.toml --out "$out"
OMP_WAIT_POLICY=PASSIVE "$py" scripts/torch_round.py --threads "$threads" --rounds 3 | tail -1 > "$out/torch.json"
python3 - "$out" "$threads" <<'PY'
import json, sys, platform
out, threads = sys.argv[1], int(sys.argv[2])
run = json.load(open(f"{out}/runs/fedavg-local-seed0.json"))
rounds = [r["seconds"] + v for r, v in zip(run["rounds"], run["val_seconds"])]
ours = sum(rounds[1:]) / len(rounds[1:])
torch = json.load(open(f"{out}/torch.json"))
ratio = ours / torch["seconds_per_round"]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
res = {
    "command": f"./scripts/runner_speed.sh {threads}",
    "cpu": cpu,
    "threads": threads,
    "runner_seconds_per_round": ours,
    "runner_rounds_seconds": rounds,
    "pytorch": torch,
    "ratio_runner_over_pytorch": ratio,
    "note": "rounds 2 and 3 (round 1 warms up); FedBN, 5 sites x 743 training images, every site evaluated on 700 images",
}
json.dump(res, open("results/runner-speed.json", "w"), indent=2)
md = (f"# Experiment runner speed\n\n`{res['command']}` on {cpu}, {threads} threads.\n\n"
      f"| | seconds per round |\n|---|---:|\n| runner (in-process federation, real messages) | {ours:.2f} |\n"
      f"| plain PyTorch {torch['torch_version']} | {torch['seconds_per_round']:.2f} |\n"
      f"| **ratio** | **{ratio:.2f}x** |\n")
open("results/runner-speed.md", "w").write(md)
print(md)
PY
