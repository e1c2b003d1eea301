#!/usr/bin/env python3
"""Generate PyTorch reference fixtures for the Rust (burn) model implementations.

For every model this writes, under models/tests/fixtures/:

  <name>.safetensors     the model's full state_dict() (incl. BN running_mean,
                         running_var, and num_batches_tracked as int64)
  <name>-io.safetensors  input        float32, a batch of 4 N(0,1) samples
                         logits       float32, eval-mode output (BN uses running stats)
                         logits_train float32, train-mode output of a deep copy
                                      (BN uses batch statistics)

and a README.md listing tensor names/shapes, torch version, file sizes and
sha256 digests.

Regenerate with (from the repository root):

    .venv/bin/python scripts/make_torch_fixtures.py

The output is deterministic for a given torch version (CPU only, fixed seeds).
"""

import copy
import hashlib
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
OUT_DIR = os.path.join(REPO_ROOT, "models", "tests", "fixtures")
REGEN_CMD = ".venv/bin/python scripts/make_torch_fixtures.py"
SEED = 1234
BATCH = 4


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(20, 16)
        self.bn1 = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 16)
        self.bn2 = nn.BatchNorm1d(16)
        self.fc3 = nn.Linear(16, 3)

    def forward(self, x):
        x = F.relu(self.bn1(self.fc1(x)))
        x = F.relu(self.bn2(self.fc2(x)))
        return self.fc3(x)


class DigitModel(nn.Module):
    """FedBN DigitModel layout, with configurable widths."""

    def __init__(self, c=(64, 64, 128), f=(2048, 512), num_classes=10):
        super().__init__()
        c1, c2, c3 = c
        f1, f2 = f
        self.conv1 = nn.Conv2d(3, c1, 5, 1, 2)
        self.bn1 = nn.BatchNorm2d(c1)
        self.conv2 = nn.Conv2d(c1, c2, 5, 1, 2)
        self.bn2 = nn.BatchNorm2d(c2)
        self.conv3 = nn.Conv2d(c2, c3, 5, 1, 2)
        self.bn3 = nn.BatchNorm2d(c3)
        self.fc1 = nn.Linear(c3 * 7 * 7, f1)
        self.bn4 = nn.BatchNorm1d(f1)
        self.fc2 = nn.Linear(f1, f2)
        self.bn5 = nn.BatchNorm1d(f2)
        self.fc3 = nn.Linear(f2, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = F.relu(self.bn3(self.conv3(x)))
        x = x.view(x.shape[0], -1)
        x = F.relu(self.bn4(self.fc1(x)))
        x = F.relu(self.bn5(self.fc2(x)))
        return self.fc3(x)


class BasicBlock(nn.Module):
    """torchvision.models.resnet.BasicBlock (same attribute names)."""

    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out = out + identity
        return self.relu(out)


class ResNet18(nn.Module):
    """torchvision-style ResNet-18 (BasicBlock, [2,2,2,2]) with configurable width/stem."""

    def __init__(self, base=8, in_channels=1, num_classes=5, stem="cifar"):
        super().__init__()
        self.inplanes = base
        if stem == "cifar":
            self.conv1 = nn.Conv2d(in_channels, base, 3, stride=1, padding=1, bias=False)
        elif stem == "imagenet":
            self.conv1 = nn.Conv2d(in_channels, base, 7, stride=2, padding=3, bias=False)
        else:
            raise ValueError(stem)
        self.bn1 = nn.BatchNorm2d(base)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1) if stem == "imagenet" else None
        self.layer1 = self._make_layer(base, 2, stride=1)
        self.layer2 = self._make_layer(base * 2, 2, stride=2)
        self.layer3 = self._make_layer(base * 4, 2, stride=2)
        self.layer4 = self._make_layer(base * 8, 2, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(base * 8, num_classes)

    def _make_layer(self, planes, blocks, stride):
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes),
            )
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        for _ in range(1, blocks):
            layers.append(BasicBlock(self.inplanes, planes))
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        if self.maxpool is not None:
            x = self.maxpool(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.fc(x)


# name -> (constructor, input shape without batch dim, number of classes)
MODELS = [
    ("mlp", lambda: Mlp(), (20,), 3),
    ("digits_small", lambda: DigitModel(c=(4, 6, 8), f=(32, 16), num_classes=10), (3, 28, 28), 10),
    ("resnet18_small", lambda: ResNet18(8, 1, 5, stem="cifar"), (1, 32, 32), 5),
    ("resnet18_imagenet_small", lambda: ResNet18(8, 1, 5, stem="imagenet"), (1, 64, 64), 5),
]


# --------------------------------------------------------------------------
# Fixture generation
# --------------------------------------------------------------------------


def put_life(model, in_shape, num_classes, gen):
    """3 SGD steps in train mode on random data, then randomize all BN state."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    for _ in range(3):
        x = torch.randn((8,) + in_shape, generator=gen)
        y = torch.randint(0, num_classes, (8,), generator=gen)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                assert m.eps == 1e-5 and m.momentum == 0.1
                m.weight.copy_(torch.empty_like(m.weight).uniform_(0.5, 1.5, generator=gen))
                m.bias.copy_(torch.empty_like(m.bias).uniform_(-0.5, 0.5, generator=gen))
                m.running_var.copy_(torch.empty_like(m.running_var).uniform_(0.5, 2.0, generator=gen))
                m.running_mean.copy_(torch.empty_like(m.running_mean).normal_(0.0, 0.5, generator=gen))


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def describe(tensors):
    return [(k, str(v.dtype).replace("torch.", ""), list(v.shape)) for k, v in tensors.items()]


def main():
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # avoid any thread-count dependent reduction order
    os.makedirs(OUT_DIR, exist_ok=True)

    report = []  # (file name, [(tensor, dtype, shape)], size, sha)
    for idx, (name, ctor, in_shape, num_classes) in enumerate(MODELS):
        torch.manual_seed(SEED + idx)
        gen = torch.Generator().manual_seed(SEED + 100 + idx)
        model = ctor()
        put_life(model, in_shape, num_classes, gen)

        x = torch.randn((BATCH,) + in_shape, generator=gen)

        train_copy = copy.deepcopy(model)
        train_copy.train()
        with torch.no_grad():
            logits_train = train_copy(x)

        model.eval()
        with torch.no_grad():
            logits = model(x)

        state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        for k, v in state.items():
            if k.endswith("num_batches_tracked"):
                assert v.dtype == torch.int64, k
            else:
                assert v.dtype == torch.float32, k
        io = {
            "input": x.contiguous(),
            "logits": logits.contiguous(),
            "logits_train": logits_train.contiguous(),
        }

        for fname, tensors in ((f"{name}.safetensors", state), (f"{name}-io.safetensors", io)):
            path = os.path.join(OUT_DIR, fname)
            # A single metadata key: safetensors stores metadata in a hash map, so with
            # several keys their order in the header (and thus the bytes) varies per run.
            save_file(tensors, path,
                      metadata={"generated_by": f"scripts/make_torch_fixtures.py torch {torch.__version__}"})
            os.chmod(path, 0o644)
            report.append((fname, describe(tensors), os.path.getsize(path), sha256(path)))

    # ---- human readable report (stdout + README.md) ----
    lines = []
    lines.append("# PyTorch reference fixtures")
    lines.append("")
    lines.append("Generated by `scripts/make_torch_fixtures.py` from real PyTorch (CPU).")
    lines.append("")
    lines.append(f"- torch version: `{torch.__version__}`")
    lines.append(f"- regenerate (from the repository root): `{REGEN_CMD}`")
    lines.append("  (venv: `python3 -m venv .venv && .venv/bin/pip install torch numpy safetensors`)")
    lines.append("- output is byte-for-byte deterministic for a given torch version")
    lines.append("")
    lines.append("Models (all BatchNorm layers: eps 1e-5, momentum 0.1):")
    lines.append("")
    lines.append("- `mlp`: fc1 Linear(20,16) -> bn1 BN1d -> relu -> fc2 Linear(16,16) -> bn2 BN1d -> relu -> fc3 Linear(16,3); input [4,20]")
    lines.append("- `digits_small`: FedBN DigitModel with widths conv 4,6,8 (5x5, stride 1, pad 2) and fc 392->32->16->10;"
                 " conv-bn-relu-maxpool2 x2, conv-bn-relu, flatten (NCHW order), fc-bn-relu x2, fc; input [4,3,28,28]")
    lines.append("- `resnet18_small`: torchvision ResNet-18 naming, BasicBlock [2,2,2,2], widths 8,16,32,64, in_channels 1,"
                 " 5 classes, CIFAR stem conv1 3x3/s1/p1 (no bias), bn1, relu, no maxpool; strides 1,2,2,2;"
                 " adaptive avgpool(1), fc Linear(64,5); input [4,1,32,32]")
    lines.append("- `resnet18_imagenet_small`: same but torchvision stem conv1 7x7/s2/p3 (no bias), bn1, relu,"
                 " maxpool 3/s2/p1; input [4,1,64,64]")
    lines.append("")
    lines.append("How they were made: `torch.manual_seed`, default init, 3 SGD steps (lr 0.1, batch 8, cross-entropy on"
                 " random N(0,1) data / random labels) in train mode, then every BN weight ~ U(0.5,1.5), bias ~ U(-0.5,0.5),"
                 " running_var ~ U(0.5,2.0), running_mean ~ N(0,0.5). `<name>.safetensors` is the full `state_dict()`"
                 " (num_batches_tracked is int64, = 3). `<name>-io.safetensors` holds `input` (N(0,1)),"
                 " `logits` (eval-mode output under `torch.no_grad()`), and `logits_train` (train-mode output of a deep"
                 " copy of the model, i.e. BN with batch statistics, biased variance for normalization).")
    lines.append("")
    for fname, tensors, size, digest in report:
        lines.append(f"## `{fname}`")
        lines.append("")
        lines.append(f"size {size} bytes, sha256 `{digest}`")
        lines.append("")
        lines.append("```")
        w = max(len(k) for k, _, _ in tensors)
        for k, dt, shape in tensors:
            lines.append(f"{k.ljust(w)}  {dt:<7}  {shape}")
        lines.append("```")
        lines.append("")
    text = "\n".join(lines)
    with open(os.path.join(OUT_DIR, "README.md"), "w") as f:
        f.write(text)
    print(text)

    too_big = [(f, s) for f, _, s, _ in report if s > 1_000_000]
    if too_big:
        print(f"WARNING: fixtures over 1 MB: {too_big}", file=sys.stderr)


if __name__ == "__main__":
    main()
