"""Writes Hugging Face folders in the torch.save layout (pytorch_model.bin) with the torch this
interpreter has (Debian 12's 1.13 under /usr/bin/python3, 2.6 in the Debian 13 root), for
tests/hf/test_hf_import.cpp.

    python3 tests/torch_save_fixture.py OUT_DIR

OUT_DIR/single/pytorch_model.bin: a state dict of every dtype shardsafe reads, with what torch
keeps of a tensor's storage: a tied pair (one storage, two names), slices of one fused storage
(a storage offset), a transposed tensor and a channels_last weight (strides kept), a 0-d and an
empty tensor, an nn.Parameter. OUT_DIR/sharded/: two files and pytorch_model.bin.index.json, as
transformers shards. OUT_DIR/nested/: {"model": {...}, "layers": [...]}, names flattened with '.'.
OUT_DIR/expected.json: per folder, per flattened name, its dtype, shape and where its row-major
bytes are in OUT_DIR/expected.bin (computed by torch, not by shardsafe), and their sha256.
Refused inputs: OUT_DIR/others/ (an int beside a tensor), OUT_DIR/gappy/ (a slice whose
elements are not consecutive in its storage), OUT_DIR/legacy/ (torch.save's pre-1.6 format).
Each file is read back by torch.load before the script ends.
"""
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_compat  # noqa: E402,F401  (torch 1.13 on Python 3.11)
import torch  # noqa: E402

DTYPE = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
         torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
         torch.uint8: "U8", torch.bool: "BOOL"}


def raw(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def flatten(v, name, out):
    if isinstance(v, torch.Tensor):
        out[name] = v
    elif isinstance(v, dict):
        for k, x in v.items():
            flatten(x, f"{name}.{k}" if name else str(k), out)
    else:
        for i, x in enumerate(v):
            flatten(x, f"{name}.{i}", out)


def main(out):
    torch.manual_seed(11)
    embed = torch.randn(16, 8)
    fused = torch.randn(6, 4).to(torch.bfloat16)
    single = {
        "embed.weight": embed,
        "lm_head.weight": embed,                       # tied: one storage
        "proj.weight": torch.randn(5, 7).t(),          # [7, 5], stored as [5, 7]
        "fused": fused,
        "q": fused[0:2], "k": fused[2:4], "v": fused[4:6],  # slices: storage offsets 0, 8, 16
        "conv.weight": torch.randn(4, 3, 3, 3).to(torch.float16).to(memory_format=torch.channels_last),
        "ids": torch.arange(10, dtype=torch.int64) * 1234567891,
        "i32": torch.arange(-5, 6, dtype=torch.int32), "i16": torch.arange(-3, 4, dtype=torch.int16),
        "i8": torch.arange(-8, 8, dtype=torch.int8), "u8": torch.arange(0, 250, 7, dtype=torch.uint8),
        "mask": torch.tensor([True, False, True, True]),
        "scale": torch.tensor(3.25, dtype=torch.float64),  # 0-d
        "empty": torch.zeros(0, 4),
        "param": torch.nn.Parameter(torch.randn(3, 2)),
        "tall": torch.randn(40, 3).t()[:, 5:25],       # [3, 20] of a transposed storage, offset 5
    }
    nested = {"model": {"w": torch.randn(3, 3), "b": torch.randn(3)},
              "layers": [torch.randn(2, 2), torch.randn(2, 2).t()]}
    expected, blob = {}, bytearray()
    for folder, sd in (("single", single), ("nested", nested)):
        os.makedirs(os.path.join(out, folder))
        torch.save(sd, os.path.join(out, folder, "pytorch_model.bin"))
    os.makedirs(os.path.join(out, "sharded"))
    parts = [{k: single[k] for k in ("embed.weight", "proj.weight", "scale")},
             {k: single[k] for k in ("fused", "q", "conv.weight", "mask")}]
    weight_map = {}
    for i, part in enumerate(parts):
        name = f"pytorch_model-{i + 1:05d}-of-{len(parts):05d}.bin"
        torch.save(part, os.path.join(out, "sharded", name))
        weight_map.update({k: name for k in part})
    with open(os.path.join(out, "sharded", "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f, indent=2)
    for folder, sd in (("single", single), ("nested", nested), ("sharded", {k: v for p in parts for k, v in p.items()})):
        flat = {}
        flatten(sd, "", flat)
        expected[folder] = {}
        for k, t in flat.items():
            b = raw(t)
            expected[folder][k] = {"dtype": DTYPE[t.dtype], "shape": list(t.shape), "offset": len(blob), "len": len(b),
                                   "sha256": hashlib.sha256(b).hexdigest()}
            blob += b
    # torch reads each back as written
    for folder in ("single", "nested"):
        back = {}
        flatten(torch.load(os.path.join(out, folder, "pytorch_model.bin")), "", back)
        assert sorted(back) == sorted(expected[folder]), folder
        for k, t in back.items():
            e = expected[folder][k]
            assert raw(t) == bytes(blob[e["offset"]:e["offset"] + e["len"]]), (folder, k)
    for folder, sd, kw in (("others", {"w": torch.randn(2), "epoch": 3}, {}),
                           ("gappy", {"g": torch.randn(4, 4)[:, :2]}, {}),
                           ("legacy", {"w": torch.randn(2)}, {"_use_new_zipfile_serialization": False})):
        os.makedirs(os.path.join(out, folder))
        torch.save(sd, os.path.join(out, folder, "pytorch_model.bin"), **kw)
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
    with open(os.path.join(out, "expected.bin"), "wb") as f:
        f.write(blob)


if __name__ == "__main__":
    main(sys.argv[1])
