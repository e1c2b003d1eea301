#!/usr/bin/env python3
"""Plain PyTorch doing what one round of the experiment runner does, for its speed ratio.

One round of FedBN on the full-size digits CNN (FedBN's DigitModel) with S sites: each site
copies the global non-BN weights into its own model (its BN stays its own), trains one epoch of
N images in shuffled batches of 32 (plain SGD, lr 0.01, cross-entropy), the server averages the
non-BN weights, and every site evaluates the new model on V validation and T test images
(batches of 256, eval mode). No messages, no encoding, no signatures: the floor a federated
runner can approach on these cores. The images are random tensors of the right shape (speed
does not depend on their content).

Usage:
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python scripts/torch_round.py --threads 2 --rounds 3

The last line of stdout is a JSON object with the seconds per round (the first round, a
warm-up, is left out of the mean).
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--sites", type=int, default=5)
p.add_argument("--train", type=int, default=743)
p.add_argument("--val", type=int, default=100)
p.add_argument("--test", type=int, default=600)
p.add_argument("--rounds", type=int, default=3)
args = p.parse_args()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_torch_fixtures import DigitModel  # noqa: E402


def is_bn(name):
    return name.startswith("bn")


def main():
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    sites = [DigitModel() for _ in range(args.sites)]
    data = [
        (
            torch.randn(args.train, 3, 28, 28, generator=gen),
            torch.randint(0, 10, (args.train,), generator=gen),
            torch.randn(args.val + args.test, 3, 28, 28, generator=gen),
            torch.randint(0, 10, (args.val + args.test,), generator=gen),
        )
        for _ in range(args.sites)
    ]
    global_w = {k: v.clone() for k, v in sites[0].state_dict().items() if not is_bn(k)}
    times = []
    for r in range(args.rounds):
        t0 = time.perf_counter()
        for m, (x, y, _, _) in zip(sites, data):
            m.load_state_dict(global_w, strict=False)
            m.train()
            opt = torch.optim.SGD(m.parameters(), lr=0.01)
            order = torch.randperm(args.train, generator=gen)
            for i in range(0, args.train, 32):
                idx = order[i : i + 32]
                if len(idx) < 2:
                    continue
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(m(x[idx]), y[idx])
                loss.item()
                loss.backward()
                opt.step()
        with torch.no_grad():
            states = [m.state_dict() for m in sites]
            global_w = {k: torch.stack([s[k].float() for s in states]).mean(0) for k in global_w}
        correct = 0
        for m, (_, _, xe, ye) in zip(sites, data):
            m.load_state_dict(global_w, strict=False)
            m.eval()
            with torch.inference_mode():
                for i in range(0, len(ye), 256):
                    correct += (m(xe[i : i + 256]).argmax(1) == ye[i : i + 256]).sum().item()
        times.append(time.perf_counter() - t0)
        print(f"round {r + 1}: {times[-1]:.2f} s", file=sys.stderr)
    timed = times[1:] if len(times) > 1 else times
    print(json.dumps({
        "framework": "pytorch",
        "torch_version": torch.__version__,
        "threads": args.threads,
        "sites": args.sites,
        "train_images_per_site": args.train,
        "eval_images_per_site": args.val + args.test,
        "seconds_per_round": sum(timed) / len(timed),
        "rounds_timed": len(timed),
    }))


main()
