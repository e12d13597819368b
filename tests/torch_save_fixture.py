"""Writes Hugging Face folders in the torch.save layout (pytorch_model.bin) with the torch this
interpreter has (Debian 12's 1.13 under /usr/bin/python3, 2.6 in the Debian 13 root), for
tests/hf/test_hf_import.cpp.

    python3 tests/torch_save_fixture.py OUT_DIR

OUT_DIR/single/pytorch_model.bin: a state dict of every dtype shardsafe reads, with what torch
keeps of a tensor's storage: a tied pair (one storage, two names), slices of one fused storage
(a storage offset), a transposed tensor and a channels_last weight (strides kept), a 0-d and an
empty tensor, an nn.Parameter. OUT_DIR/sharded/: two files and pytorch_model.bin.index.json, as
transformers shards. OUT_DIR/nested/: {"model": {...}, "layers": [...]}, names flattened with '.'.
OUT_DIR/single_legacy/, sharded_legacy/, nested_legacy/: the same in torch.save's legacy format
(torch < 1.6, _use_new_zipfile_serialization=False); OUT_DIR/single_legacy4/ too, its pickles
of protocol 4.
OUT_DIR/expected.json: per folder, per flattened name, its dtype, shape and where its row-major
bytes are in OUT_DIR/expected.bin (computed by torch, not by shardsafe), and their sha256.
Refused inputs: OUT_DIR/others/ (an int beside a tensor), OUT_DIR/gappy/ (a slice whose
elements are not consecutive in its storage), OUT_DIR/legacy_size/ (a legacy file whose first
storage's size in the file is one more than its pickle says), OUT_DIR/legacy_short/ (a legacy
file cut 100 bytes short): torch.load refuses the last two as well. OUT_DIR/popped/ and
popped_legacy/: a persistent id, popped at once, names the F16 tensor's storage as F32 first
(torch then gives the tensor as F32).
OUT_DIR/train/train.pt and train_legacy/train.pt: a training checkpoint (a model's, an AdamW
optimizer's and an LR scheduler's state dicts after two steps, an epoch, a loss, plain values);
its tensors in expected.json under "train" (with their paths), its other values in
OUT_DIR/expected_values.json: per name as torch.distributed.checkpoint flattens them, the path,
the value pickled by Python (protocol 2, hex) and its repr().
Each file is read back by torch.load before the script ends.
"""
import hashlib
import io
import json
import os
import pickle
import pickletools
import struct
import sys
import zipfile

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


def dcp_flatten(sd):
    """The leaves of a nested state dict as torch.distributed.checkpoint's flatten_state_dict
    takes them (torch 2.x's _traverse rules, written out for torch 1.13, which has no DCP): a dict
    is walked by str(key); a list by index when an item is a tensor, a dict or a list so walked;
    anything else (a tuple, a list of plain values, a scalar, a tensor) is one leaf. Returns
    {name: (path, value)}, name the path's parts joined by '.'."""
    out = {}

    def whole(v):
        if isinstance(v, dict):
            return False
        if not isinstance(v, list):
            return True
        return all(not isinstance(e, torch.Tensor) and not (isinstance(e, (dict, list)) and not whole(e)) for e in v)

    def walk(path, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(path + (str(k),), x)
        elif whole(v):
            out[".".join(map(str, path))] = (path, v)
        else:
            for i, x in enumerate(v):
                walk(path + (i,), x)

    walk((), sd)
    return out


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
    parts = [{k: single[k] for k in ("embed.weight", "proj.weight", "scale")},
             {k: single[k] for k in ("fused", "q", "conv.weight", "mask")}]
    os.makedirs(os.path.join(out, "single_legacy4"))  # pickles of protocol 4 (FRAME, MEMOIZE, ...)
    torch.save(single, os.path.join(out, "single_legacy4", "pytorch_model.bin"), _use_new_zipfile_serialization=False, pickle_protocol=4)
    for suffix, kw in (("", {}), ("_legacy", {"_use_new_zipfile_serialization": False})):
        for folder, sd in (("single", single), ("nested", nested)):
            os.makedirs(os.path.join(out, folder + suffix))
            torch.save(sd, os.path.join(out, folder + suffix, "pytorch_model.bin"), **kw)
        os.makedirs(os.path.join(out, "sharded" + suffix))
        weight_map = {}
        for i, part in enumerate(parts):
            name = f"pytorch_model-{i + 1:05d}-of-{len(parts):05d}.bin"
            torch.save(part, os.path.join(out, "sharded" + suffix, name), **kw)
            weight_map.update({k: name for k in part})
        with open(os.path.join(out, "sharded" + suffix, "pytorch_model.bin.index.json"), "w") as f:
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
    for folder in ("single", "nested", "single_legacy", "nested_legacy", "single_legacy4"):
        back, want = {}, expected[folder.split("_")[0]]
        # weights_only=False: torch 2.6's restricted unpickler takes no protocol-4 FRAME (single_legacy4)
        flatten(torch.load(os.path.join(out, folder, "pytorch_model.bin"), weights_only=False), "", back)
        assert sorted(back) == sorted(want), folder
        for k, t in back.items():
            e = want[k]
            assert raw(t) == bytes(blob[e["offset"]:e["offset"] + e["len"]]), (folder, k)
    for folder, sd in (("others", {"w": torch.randn(2), "epoch": 3}), ("gappy", {"g": torch.randn(4, 4)[:, :2]})):
        os.makedirs(os.path.join(out, folder))
        torch.save(sd, os.path.join(out, folder, "pytorch_model.bin"))
    # a legacy file damaged: its first storage's size (the int64 after the five pickles) one
    # more, and the file cut short; torch refuses both
    legacy = open(os.path.join(out, "single_legacy", "pytorch_model.bin"), "rb").read()
    f = io.BytesIO(legacy)
    for _ in range(5):  # each pickle's opcodes up to its STOP (nothing is unpickled)
        for _ in pickletools.genops(f):
            pass
    data = f.tell()
    numel = struct.unpack_from("<q", legacy, data)[0]
    for folder, damaged in (("legacy_size", legacy[:data] + struct.pack("<q", numel + 1) + legacy[data + 8:]),
                            ("legacy_short", legacy[:-100])):
        os.makedirs(os.path.join(out, folder))
        path = os.path.join(out, folder, "pytorch_model.bin")
        with open(path, "wb") as g:
            g.write(damaged)
        try:
            torch.load(path, weights_only=False)
        except Exception:
            pass
        else:
            raise AssertionError(f"torch loads {folder}")
    # a persistent id no tensor holds (popped at once, before the state dict) naming a tensor's
    # storage as F32: torch makes the storage from it and gives the F16 tensor as F32
    def pid(key, numel):
        return (b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX" + struct.pack("<I", len(key)) + key +
                b"X\x03\x00\x00\x00cpu" + bytes([0x4b, numel]))
    half = {"b": torch.arange(4, dtype=torch.float16)}
    buf = io.BytesIO()
    torch.save(half, buf, _use_new_zipfile_serialization=False)
    leg = buf.getvalue()
    f, ends = io.BytesIO(leg), []
    for _ in range(5):
        for _ in pickletools.genops(f):
            pass
        ends.append(f.tell())
    # the storage list's one key
    key = [a for op, a, _ in pickletools.genops(io.BytesIO(leg[ends[3]:ends[4]])) if op.name == "BINUNICODE"][0].encode()
    popped_legacy = leg[:ends[2] + 2] + pid(key, 4) + b"NtQ0" + leg[ends[2] + 2:] + b"\0" * 8
    buf = io.BytesIO()
    torch.save({"b": half["b"][:2]}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out_zip = io.BytesIO()
    with zipfile.ZipFile(out_zip, "w", zipfile.ZIP_STORED) as z:
        for n in src.namelist():
            data = src.read(n)
            z.writestr(n, data[:2] + pid(b"0", 2) + b"tQ0" + data[2:] if n.endswith("/data.pkl") else data)
    for folder, data in (("popped_legacy", popped_legacy), ("popped", out_zip.getvalue())):
        os.makedirs(os.path.join(out, folder))
        path = os.path.join(out, folder, "pytorch_model.bin")
        with open(path, "wb") as g:
            g.write(data)
        assert torch.load(path, weights_only=False)["b"].dtype == torch.float32, folder  # its restricted unpickler refuses POP
    # a training checkpoint: a model, its AdamW optimizer and LR scheduler after two steps, and
    # plain values; its tensors as flattened, its values as torch.distributed.checkpoint keeps
    # them (dcp_flatten), each pickled by Python (protocol 2) with its repr() and path
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        loss = model(torch.randn(5, 4)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    train = {"model_state_dict": model.state_dict(), "optimizer_state_dict": opt.state_dict(),
             "scheduler": sched.state_dict(), "epoch": 3, "loss": loss.item(), "note": "adam w", "none": None,
             "grid": [[1, 2], [3]], "flags": (True, False), "mixed": [torch.arange(3), 5, {"k": 1.5}], "empty": [],
             "big": 2 ** 62, "inf": float("-inf"), "keys": {True: 1, None: torch.ones(2), 0.5: "half", 7: [8]}}
    values = {}
    for suffix, kw in (("", {}), ("_legacy", {"_use_new_zipfile_serialization": False})):
        os.makedirs(os.path.join(out, "train" + suffix))
        torch.save(train, os.path.join(out, "train" + suffix, "train.pt"), **kw)
    expected["train"] = {}
    for name, (path, v) in sorted(dcp_flatten(train).items()):
        if isinstance(v, torch.Tensor):
            b = raw(v)
            expected["train"][name] = {"dtype": DTYPE[v.dtype], "shape": list(v.shape), "offset": len(blob), "len": len(b),
                                       "sha256": hashlib.sha256(b).hexdigest(), "path": list(path)}
            blob += b
        else:
            values[name] = {"path": list(path), "pickle": pickle.dumps(v, protocol=2).hex(), "repr": repr(v)}
    try:  # torch 2.x: dcp_flatten is torch's own flatten_state_dict
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
        _, mapping = flatten_state_dict(train)
        assert {k: tuple(p) for k, p in mapping.items()} == {k: p for k, (p, _) in dcp_flatten(train).items()}
    except ImportError:  # torch 1.13 has no torch.distributed.checkpoint
        pass
    for folder in ("train", "train_legacy"):
        back = dcp_flatten(torch.load(os.path.join(out, folder, "train.pt")))
        assert sorted(back) == sorted(list(expected["train"]) + list(values)), folder
    with open(os.path.join(out, "expected_values.json"), "w") as f:
        json.dump(values, f, indent=1, sort_keys=True)
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
    with open(os.path.join(out, "expected.bin"), "wb") as f:
        f.write(blob)


if __name__ == "__main__":
    main(sys.argv[1])
