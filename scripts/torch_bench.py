#!/usr/bin/env python3
"""PyTorch CPU baseline for the full-size FedBN digits CNN.

Model (FedBN DigitModel): conv 3->64->64->128 (5x5, stride 1, pad 2) with BN/ReLU,
max-pool after the first two, flatten 128*7*7 = 6272 -> fc 2048 -> 512 -> 10 with
BN1d/ReLU on the hidden fc layers. Input [N,3,28,28].

Measures:
  * training: plain SGD (lr 0.01, no momentum), cross-entropy; per step:
    forward, loss, loss.item(), backward, optimizer step
  * inference: eval mode under torch.inference_mode(), batch 32 and 256,
    output copied to numpy every iteration
  both on the first samples of --inputs (the built-in images `unifed-agent bench` writes, the
  same bytes burn measures on), or on N(0,1) noise without it

Usage:
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python scripts/torch_bench.py --threads 2

(The script also sets OMP_WAIT_POLICY=PASSIVE itself, before importing torch, unless
already set; setting it in the shell makes it explicit. Passive waiting keeps idle
OpenMP threads from spinning, which matters when the machine is shared.)

With --layers JSON (a list of layers, as `unifed-agent bench --layers` passes it), each layer
is also timed alone on an input of its shape: forward (ending in a sum of the output) and
forward plus backward, --warmup untimed and --steps timed passes each, as burn's side does.

The last line of stdout is a JSON object with the results.
"""

import argparse
import json
import os
import resource
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def current_rss_mib():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (intra-op threads)")
    p.add_argument("--batch", type=int, default=32, help="training batch size")
    p.add_argument("--warmup", type=int, default=5, help="training warmup steps")
    p.add_argument("--steps", type=int, default=50, help="timed training steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda (timings synchronise with the GPU)")
    p.add_argument("--layers", help="JSON list of layers to time one by one (from unifed-agent bench)")
    p.add_argument("--inputs", help="samples to train and infer on, as unifed-agent bench writes them "
                   "(count u32, values f32 [n,3,28,28], labels i64, little-endian); default N(0,1) noise")
    return p.parse_args()


args = parse_args()

import torch  # noqa: E402  (after OMP_WAIT_POLICY is set)
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

rss_after_import_mib = current_rss_mib()


# The same FedBN DigitModel the committed fixtures come from (paper widths by default).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_torch_fixtures import DigitModel  # noqa: E402


def load_inputs(path):
    """The samples file of `unifed-agent bench`: (values [n,3,28,28], labels [n])."""
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:4], "little")
    values = 4 + n * 3 * 28 * 28 * 4
    if len(raw) != values + n * 8:
        raise SystemExit(f"{path}: {len(raw)} bytes, not the {values + n * 8} of {n} samples")
    x = torch.frombuffer(bytearray(raw[4:values]), dtype=torch.float32).reshape(n, 3, 28, 28)
    y = torch.frombuffer(bytearray(raw[values:]), dtype=torch.int64)
    return x, y


def samples(batch, gen):
    """The first `batch` samples of --inputs, else N(0,1) noise and random labels."""
    if INPUTS is not None:
        x, y = INPUTS
        if batch > len(y):
            raise SystemExit(f"--inputs holds {len(y)} samples, fewer than a batch of {batch}")
        return x[:batch].clone().to(args.device), y[:batch].clone().to(args.device)
    x = torch.randn(batch, 3, 28, 28, generator=gen).to(args.device)
    y = torch.randint(0, 10, (batch,), generator=gen).to(args.device)
    return x, y


INPUTS = load_inputs(args.inputs) if args.inputs else None


def bench_train(model, batch, warmup, steps, gen):
    x, y = samples(batch, gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.0)
    model.train()

    def step():
        opt.zero_grad(set_to_none=True)
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss_val = loss.item()
        loss.backward()
        opt.step()
        return loss_val

    for _ in range(warmup):
        step()
    t0 = time.perf_counter()
    last = None
    for _ in range(steps):
        last = step()
    dt = time.perf_counter() - t0
    return steps * batch / dt, dt, last


def bench_infer(model, batch, warmup, iters, gen):
    x, _ = samples(batch, gen)
    model.eval()
    sink = None
    with torch.inference_mode():
        for _ in range(warmup):
            sink = model(x).cpu().numpy().copy()
        t0 = time.perf_counter()
        for _ in range(iters):
            sink = model(x).cpu().numpy().copy()
        dt = time.perf_counter() - t0
    assert sink.shape == (batch, 10)
    return iters * batch / dt, dt


def make_layer(layer):
    """The torch module a layer of `unifed-agent bench --layers` describes."""
    kind, shape = layer["kind"], layer["input"]
    if kind == "conv":
        return nn.Conv2d(shape[1], layer["out_channels"], layer["kernel"], 1, layer["padding"])
    if kind == "batch_norm":
        norms = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}
        if len(shape) not in norms:
            raise ValueError(f"layer {layer.get('name')!r}: no BatchNorm takes a {len(shape)}-D input")
        return norms[len(shape)](shape[1])
    if kind == "relu":
        return nn.ReLU()
    if kind == "max_pool2":
        return nn.MaxPool2d(2)
    if kind == "linear":
        return nn.Linear(shape[1], layer["out_features"])
    raise ValueError(f"layer {layer.get('name')!r}: unknown kind {kind!r}")


def bench_layers(spec, gen, warmup, iters):
    """Milliseconds per forward and per forward+backward pass of each layer alone."""

    def ms(f):
        for _ in range(warmup):
            f()
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            f()
        if args.device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3 / max(iters, 1)

    out = []
    for layer in spec:
        m = make_layer(layer).to(args.device).train()
        x = torch.randn(*layer["input"], generator=gen).to(args.device)
        x.requires_grad_(bool(layer["grad_input"]))

        def fwd():
            return m(x).sum()

        def fwd_bwd():
            # Fresh gradients each pass, as an optimizer's zero_grad(set_to_none=True) leaves them.
            for p in m.parameters():
                p.grad = None
            x.grad = None
            fwd().backward()

        out.append({"name": layer["name"], "fwd_ms": ms(fwd), "fwd_bwd_ms": ms(fwd_bwd)})
    return out


def main():
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    model = DigitModel().to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"torch {torch.__version__} on {args.device}, threads={torch.get_num_threads()}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, params={n_params}", file=sys.stderr)

    train_sps, train_s, last_loss = bench_train(model, args.batch, args.warmup, args.steps, gen)
    print(f"train: batch {args.batch}, {args.steps} steps in {train_s:.3f}s -> {train_sps:.1f} samples/s "
          f"(last loss {last_loss:.4f})")
    b32_sps, b32_s = bench_infer(model, 32, 5, 50, gen)
    print(f"infer b32: 50 iters in {b32_s:.3f}s -> {b32_sps:.1f} samples/s")
    b256_sps, b256_s = bench_infer(model, 256, 2, 10, gen)
    print(f"infer b256: 10 iters in {b256_s:.3f}s -> {b256_sps:.1f} samples/s")

    result = {
        "framework": "pytorch",
        "backend": args.device,
        "torch_version": torch.__version__,
        "threads": args.threads,
        "batch": args.batch,
        "train_steps": args.steps,
        "train_samples_per_s": round(train_sps, 2),
        "infer_b32_samples_per_s": round(b32_sps, 2),
        "infer_b256_samples_per_s": round(b256_sps, 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1),
        "rss_after_import_mib": round(rss_after_import_mib, 1),
        "input": f"--inputs {args.inputs}" if args.inputs else "N(0, 1) noise",
    }
    if args.layers:
        result["layers"] = bench_layers(json.loads(args.layers), gen, args.warmup, args.steps)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
