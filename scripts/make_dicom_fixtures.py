#!/usr/bin/env python3
"""Makes the DICOM fixtures of `models/tests/models/dicom.rs` with pydicom (2.4.4) and numpy.

Usage: python3 -m venv .venv-dicom && .venv-dicom/bin/pip install pydicom==2.4.4 numpy
       .venv-dicom/bin/python scripts/make_dicom_fixtures.py models/tests/fixtures/dicom

Copies a few of pydicom's own test files (MIT licence, see the folder's README.md) and makes four
more with pydicom: a three-frame, an 8-bit and a 12-bit unsigned image from MR_small.dcm, and a
MONOCHROME1 one from CT_small.dcm. For every file it writes `<name>.json`: the geometry, the photometric
interpretation, the window, and per frame the pixel values after the modality LUT
(`pydicom.pixel_data_handlers.util.apply_modality_lut`), which our reader must equal exactly,
and the values the agent feeds a model before resizing: windowed to [0, 1] by DICOM's linear
VOI function (PS3.3 C.11.2.1.2; the file's first window, else the frame's min-max), inverted
for MONOCHROME1, computed here with numpy independently of our code.
"""
import json
import os
import shutil
import sys

import numpy as np
import pydicom
import pydicom.uid
from pydicom.pixel_data_handlers.util import apply_modality_lut

OUT = sys.argv[1]
SRC = os.path.join(os.path.dirname(pydicom.__file__), "data", "test_files")
COPIED = [
    "CT_small.dcm",      # 16-bit signed, rescale intercept -1024, no window
    "MR_small.dcm",      # 16-bit signed, window 600/1600
    "MR_small_RLE.dcm",  # the same pixels, RLE lossless
]


def windowed(values, window):
    """DICOM's linear VOI LUT to [0, 1]: window (center, width), else min-max."""
    v = values.astype(np.float64)
    if window is None:
        lo, hi = v.min(), v.max()
        return np.zeros_like(v) if hi == lo else (v - lo) / (hi - lo)
    c, w = window
    if w <= 1:
        return (v > c - 0.5).astype(np.float64)
    y = (v - (c - 0.5)) / (w - 1) + 0.5
    return np.clip(y, 0.0, 1.0)


def first(v):
    if v is None:
        return None
    return float(v[0]) if isinstance(v, pydicom.multival.MultiValue) else float(v)


def renamed(ds, name):
    """`ds` as a new instance: a SOP Instance UID of its own (derived from `name`)."""
    uid = pydicom.uid.generate_uid(entropy_srcs=[name])
    ds.SOPInstanceUID = uid
    ds.file_meta.MediaStorageSOPInstanceUID = uid
    return ds


def record(path):
    ds = pydicom.dcmread(path)
    arr = ds.pixel_array
    frames = int(ds.get("NumberOfFrames", 1) or 1)
    if frames == 1:
        arr = arr[np.newaxis, ...]
    modality = apply_modality_lut(arr, ds).astype(np.float64)
    wc, ww = first(ds.get("WindowCenter")), first(ds.get("WindowWidth"))
    window = (wc, ww) if wc is not None and ww is not None else None
    mono1 = ds.PhotometricInterpretation == "MONOCHROME1"
    model = []
    for f in modality:
        w = windowed(f, window)
        model.append((1.0 - w) if mono1 else w)
    return {
        "rows": int(ds.Rows),
        "columns": int(ds.Columns),
        "frames": frames,
        "bits_stored": int(ds.BitsStored),
        "photometric": str(ds.PhotometricInterpretation),
        "window": list(window) if window else None,
        "sop_instance_uid": str(ds.SOPInstanceUID),
        "modality": [[float(x) for x in f.ravel()] for f in modality],
        "model": [[float(x) for x in f.ravel()] for f in model],
    }


def main():
    os.makedirs(OUT, exist_ok=True)
    for name in COPIED:
        shutil.copy(os.path.join(SRC, name), os.path.join(OUT, name))
    # 12-bit unsigned: MR_small's values, masked to 12 bits.
    ds = pydicom.dcmread(os.path.join(SRC, "MR_small.dcm"))
    a = ds.pixel_array.astype(np.int32)
    a = (a - a.min()) & 0x0FFF
    ds.PixelRepresentation = 0
    ds.BitsStored = 12
    ds.HighBit = 11
    ds.PixelData = a.astype(np.uint16).tobytes()
    for tag in ("WindowCenter", "WindowWidth"):
        if tag in ds:
            del ds[tag]
    renamed(ds, "MR_small_12bit.dcm").save_as(os.path.join(OUT, "MR_small_12bit.dcm"))
    # Multi-frame: three frames of MR_small's values, the second and third shifted.
    ds = pydicom.dcmread(os.path.join(SRC, "MR_small.dcm"))
    a = ds.pixel_array.astype(np.int16)
    ds.NumberOfFrames = 3
    ds.PixelData = np.stack([a, a // 2, a - 100]).astype(np.int16).tobytes()
    renamed(ds, "MR_small_3frames.dcm").save_as(os.path.join(OUT, "MR_small_3frames.dcm"))
    # 8-bit unsigned: MR_small's values scaled to 0..255.
    ds = pydicom.dcmread(os.path.join(SRC, "MR_small.dcm"))
    a = ds.pixel_array.astype(np.float64)
    a = np.round((a - a.min()) * 255.0 / (a.max() - a.min())).astype(np.uint8)
    ds.PixelRepresentation = 0
    ds.BitsAllocated = 8
    ds.BitsStored = 8
    ds.HighBit = 7
    ds.PixelData = a.tobytes()
    for tag in ("WindowCenter", "WindowWidth"):
        if tag in ds:
            del ds[tag]
    renamed(ds, "MR_small_8bit.dcm").save_as(os.path.join(OUT, "MR_small_8bit.dcm"))
    # MONOCHROME1 (bright means low): CT_small, relabelled.
    ds = pydicom.dcmread(os.path.join(SRC, "CT_small.dcm"))
    ds.PhotometricInterpretation = "MONOCHROME1"
    renamed(ds, "CT_small_mono1.dcm").save_as(os.path.join(OUT, "CT_small_mono1.dcm"))
    made = ["MR_small_3frames.dcm", "MR_small_8bit.dcm", "MR_small_12bit.dcm", "CT_small_mono1.dcm"]
    for name in COPIED + made:
        rec = record(os.path.join(OUT, name))
        with open(os.path.join(OUT, name[:-4] + ".json"), "w") as f:
            json.dump(rec, f)
        print(name, rec["rows"], rec["columns"], rec["frames"], rec["photometric"], rec["window"])


main()
