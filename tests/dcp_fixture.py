"""Writes a torch DCP checkpoint with the torch found by this interpreter (Debian's 1.13 under
/usr/bin/python3), for tests/format/test_dcp_format.cpp.

    python3 tests/dcp_fixture.py OUT_DIR

OUT_DIR/ckpt/ holds the checkpoint (.metadata + *.distcp, one file per item) and OUT_DIR/ckpt_single/
the same state dict with single_file_per_rank=True (every item in one file, at offsets);
OUT_DIR/<name>.json says what torch read back: per key its dtype, size, chunks and storage
entries, or "bytes"; OUT_DIR/<name>.metadata_p2 is the same Metadata pickled with protocol 2;
OUT_DIR/raw/<key>.bin holds each tensor's little-endian row-major bytes. OUT_DIR/ckpt_nested/ holds
{"model": {"w": ..., "b": ...}, "step": 3}: torch 1.13 does not flatten a nested dict, so "model" is
a non-tensor item whose pickled value holds two tensors (torch's own load_state_dict reads it
back, checked here). OUT_DIR/ckpt_transposed/ holds "w", a [1030, 2000] F32 tensor that torch.save
keeps transposed (stored as [2000, 1030]), its row-major bytes in OUT_DIR/raw_transposed.bin.
OUT_DIR/ckpt_foreign/ holds "w" (F32 [3, 4], its bytes in OUT_DIR/raw_foreign_w.bin) beside tensors
of dtypes no safetensors type holds, "freqs" (complex128 [4, 2]) and "q" (qint8 [3]), and "step".
Prints "shim" on stderr when the dataclass shim (tests/torch_compat.py) was needed.
"""
import json
import os
import pickle
import sys

# torch 1.13 on Python 3.11: tests/torch_compat.py, imported before torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_compat  # noqa: E402,F401
import torch  # noqa: E402
import torch.distributed._shard.checkpoint as dcp  # noqa: E402

if torch_compat.used:
    print("shim", file=sys.stderr)

DTYPE = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
         torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
         torch.uint8: "U8", torch.bool: "BOOL"}


def main(out):
    torch.manual_seed(7)
    sd = {}
    for i, (dt, name) in enumerate(DTYPE.items()):
        shape = [(3, 5), (7,), (2, 3, 4), (4, 2)][i % 4]
        if dt.is_floating_point:
            t = torch.randn(shape).to(dt)
        elif dt == torch.bool:
            t = torch.rand(shape) > 0.5
        else:
            t = torch.randint(-100 if dt != torch.uint8 else 0, 100, shape).to(dt)
        sd["t_" + name.lower()] = t
    sd["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    sd["empty"] = torch.zeros(0, 4)
    sd["layers.0.w"] = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    sd["step"] = 17  # a non-tensor item
    os.makedirs(os.path.join(out, "raw"), exist_ok=True)
    for key, t in sd.items():
        if isinstance(t, torch.Tensor):
            t = t.contiguous()
            with open(os.path.join(out, "raw", key + ".bin"), "wb") as f:
                f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    for name, single in (("ckpt", False), ("ckpt_single", True)):
        ckpt = os.path.join(out, name)
        os.makedirs(ckpt, exist_ok=True)
        dcp.save_state_dict(sd, dcp.FileSystemWriter(ckpt, single_file_per_rank=single), no_dist=True)
        md = dcp.FileSystemReader(ckpt).read_metadata()
        with open(os.path.join(out, name + ".metadata_p2"), "wb") as f:
            pickle.dump(md, f, protocol=2)
        with open(os.path.join(out, name + ".json"), "w") as f:
            json.dump(describe(md), f, indent=1, sort_keys=True)
    save_nested(out)
    save_transposed(out)
    save_foreign(out)


def save_foreign(out):
    """Tensors of dtypes safetensors has no name for, beside one it has."""
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4) - 5.5
    r = torch.arange(8, dtype=torch.float64).reshape(4, 2)
    sd = {"w": w, "freqs": torch.complex(r, -r), "q": torch.quantize_per_tensor(torch.tensor([0.5, -1.0, 2.0]), 0.1, 0, torch.qint8),
          "step": 5}
    ckpt = os.path.join(out, "ckpt_foreign")
    dcp.save_state_dict(sd, dcp.FileSystemWriter(ckpt), no_dist=True)
    md = dcp.FileSystemReader(ckpt).read_metadata()
    assert md.state_dict_metadata["freqs"].properties.dtype == torch.complex128
    assert md.state_dict_metadata["q"].properties.dtype == torch.qint8
    with open(os.path.join(out, "raw_foreign_w.bin"), "wb") as f:
        f.write(w.reshape(-1).view(torch.uint8).numpy().tobytes())


def save_transposed(out):
    """A tensor whose storage holds its dimensions in the other order (torch.save keeps strides)."""
    t = torch.arange(1030 * 2000, dtype=torch.float32).reshape(2000, 1030).t()
    assert t.stride() == (1, 1030)
    dcp.save_state_dict({"w": t}, dcp.FileSystemWriter(os.path.join(out, "ckpt_transposed")), no_dist=True)
    with open(os.path.join(out, "raw_transposed.bin"), "wb") as f:
        f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def save_nested(out):
    """A nested dict, saved as torch 1.13 does: one pickled item holding tensors."""
    ckpt = os.path.join(out, "ckpt_nested")
    os.makedirs(ckpt, exist_ok=True)
    model = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([1.5, -2.0])}
    dcp.save_state_dict({"model": model, "step": 3}, dcp.FileSystemWriter(ckpt), no_dist=True)
    back = {"model": {"w": torch.zeros(2, 3), "b": torch.zeros(2)}, "step": 0}
    dcp.load_state_dict(back, dcp.FileSystemReader(ckpt), no_dist=True)
    assert back["step"] == 3 and all(torch.equal(back["model"][k], v) for k, v in model.items()), back


def describe(md):
    expect = {}
    for key, m in md.state_dict_metadata.items():
        if isinstance(m, dcp.metadata.BytesStorageMetadata):
            entries = [v for k, v in md.storage_data.items() if k.fqn == key]
            expect[key] = {"bytes": True, "storage": [[v.relative_path, v.offset, v.length] for v in entries]}
            continue
        chunks = []
        for c in m.chunks:
            v = md.storage_data[dcp.metadata.MetadataIndex(key, c.offsets)]
            chunks.append({"offsets": list(c.offsets), "sizes": list(c.sizes),
                           "storage": [v.relative_path, v.offset, v.length]})
        expect[key] = {"dtype": DTYPE[m.properties.dtype], "size": list(m.size), "chunks": chunks}
    return expect


if __name__ == "__main__":
    main(sys.argv[1])
