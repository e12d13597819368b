"""The tool's to-dcp output read by torch 2.x itself (tests/torch/test_dcp2.cpp).

    python3 tests/dcp2_tool_check.py hf OUT          # an HF folder made here: OUT/hf, OUT/hf_raw/KEY.bin
    python3 tests/dcp2_tool_check.py check DCP RAW   # dcp.load every tensor of DCP; each must equal RAW/KEY.bin

hf: two safetensors shards and their index, written by Python's safetensors (F32, BF16, F16, I64,
BOOL, a 0-d and an empty tensor), and every tensor's row-major bytes beside them.
check: torch's own reader (dcp.load in one process, into tensors allocated from the folder's
metadata) loads every tensor of DCP; every one must equal RAW/KEY.bin bit for bit, every file of
RAW must be a tensor of DCP. Prints "ok N tensors" and exits 0, or names what differs.
"""
import json
import os
import sys

import torch


def raw_bytes(t):
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def make_hf(out):
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(7)
    tensors = {
        "model.embed.weight": torch.randn(40, 16, generator=g),
        "model.layers.0.w": torch.randn(16, 24, generator=g).to(torch.bfloat16),
        "model.layers.0.b": torch.randn(24, generator=g).to(torch.float16),
        "model.layers.1.w": torch.randn(24, 16, generator=g),
        "model.ids": torch.arange(-5, 7, dtype=torch.int64).reshape(3, 4),
        "model.mask": torch.rand(9, generator=g) > 0.5,
        "model.scale": torch.tensor(1.5),
        "model.empty": torch.empty(0, 3),
    }
    hf = os.path.join(out, "hf")
    os.makedirs(hf, exist_ok=True)
    names = sorted(tensors)
    shards = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    total = 0
    for i, part in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: tensors[k] for k in part}, os.path.join(hf, fname))
        for k in part:
            weight_map[k] = fname
            total += tensors[k].numel() * tensors[k].element_size()
    with open(os.path.join(hf, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    raw = os.path.join(out, "hf_raw")
    os.makedirs(raw, exist_ok=True)
    for k, t in tensors.items():
        with open(os.path.join(raw, k + ".bin"), "wb") as f:
            f.write(raw_bytes(t))


def check(folder, raw):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    md = dcp.FileSystemReader(folder).read_metadata()
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
          if isinstance(m, TensorStorageMetadata)}
    dcp.load(sd, checkpoint_id=folder)  # no process group: one process reads it all
    want = {n[:-4] for n in os.listdir(raw) if n.endswith(".bin")}
    bad = []
    if want != set(sd):
        bad.append("keys differ: only in the DCP folder %s, only in the reference %s"
                   % (sorted(set(sd) - want), sorted(want - set(sd))))
    for k in sorted(want & set(sd)):
        with open(os.path.join(raw, k + ".bin"), "rb") as f:
            if raw_bytes(sd[k]) != f.read():
                bad.append(k + ": bytes differ")
    if bad:
        print("\n".join(bad))
        return 1
    print("ok %d tensors" % len(sd))
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "hf":
        make_hf(sys.argv[2])
        sys.exit(0)
    sys.exit(check(sys.argv[2], sys.argv[3]))
