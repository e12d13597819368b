"""Writes a torch DCP checkpoint from a 3-process Gloo world with the torch found by this
interpreter (Debian's 1.13 under /usr/bin/python3), for tests/checkpoint/test_dcp_load.cpp and the tool's tests.

    python3 tests/dcp_fixture_dist.py OUT_DIR [SCALE]

OUT_DIR/ckpt/ holds the checkpoint (one data file per item), OUT_DIR/ckpt_single/ the same
with single_file_per_rank=True (each rank's items in one file, at offsets); OUT_DIR/raw/<key>.bin each full tensor's little-endian
row-major bytes; OUT_DIR/digest.txt one line per tensor as `shardsafe digest` prints it
(NAME DTYPE [SHAPE] SHA256), computed here by torch; OUT_DIR/shards.json each tensor's chunks as
torch's .metadata records them. SCALE (default 1) multiplies the row counts (the benchmark
writes a large checkpoint with it).

The state dict, the same full tensors on every rank (seeded), each rank keeping its part:
- model.model.rows: F32 [10*S, 6] ShardedTensor chunked by rows over 3 ranks, unevenly (4, 4, 2);
- model.model.cols: BF16 [5, 7] chunked by columns (3, 3, 1);
- model.model.grid: F64 [6, 9] 2-D blocks, rank 1 holding two of them (two chunks of one key
  in one file);
- model.lm_head.weight: F16 [8, 4] rows (3, 3, 2);
- model.norm: F32 [6] replicated (a plain tensor on every rank: written once);
- model.conv: F32 [6, 3, 2, 2] channels_last and model.proj: F16 [6, 4] transposed, plain
  tensors written once: torch.save keeps their strides, so their data files hold the dimensions
  in another order (1.13's ShardedTensor takes contiguous pieces only);
- optim.step: I64 [] (0-d) and a non-tensor item `extra.epoch` (an int).
"""
import hashlib
import json
import os
import sys

# torch 1.13 on Python 3.11: tests/torch_compat.py, imported before torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_compat  # noqa: E402,F401
import torch_peer_world  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._shard.checkpoint as dcp  # noqa: E402
from torch.distributed._shard import sharded_tensor  # noqa: E402
from torch.distributed._shard.sharded_tensor import Shard  # noqa: E402

WORLD = 3
DTYPE = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
         torch.int64: "I64"}


def full_tensors(scale):
    g = torch.Generator().manual_seed(11)
    return {
        "model.model.rows": torch.randn(10 * scale, 6, generator=g),
        "model.model.cols": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "model.model.grid": torch.randn(6, 9, generator=g, dtype=torch.float64),
        "model.lm_head.weight": torch.randn(8, 4, generator=g).to(torch.float16),
        "model.norm": torch.randn(6, generator=g),
        "optim.step": torch.tensor(42, dtype=torch.int64),
        "model.conv": torch.randn(6, 3, 2, 2, generator=g),
        "model.proj": torch.randn(6, 4, generator=g).to(torch.float16),
    }


# plain tensors in the layout a model trained in that memory format holds (torch.save keeps it in
# the data files; 1.13's ShardedTensor takes contiguous pieces only)
LAYOUT = {
    "model.conv": lambda t: t.contiguous(memory_format=torch.channels_last),
    "model.proj": lambda t: t.t().contiguous().t(),
}


def blocks(scale):
    """key -> list of (rank, offsets, sizes)."""
    r = 10 * scale
    a = (r * 2 + 4) // 5  # uneven rows: a, a, rest
    return {
        "model.model.rows": [(0, (0, 0), (a, 6)), (1, (a, 0), (a, 6)), (2, (2 * a, 0), (r - 2 * a, 6))],
        "model.model.cols": [(0, (0, 0), (5, 3)), (1, (0, 3), (5, 3)), (2, (0, 6), (5, 1))],
        "model.model.grid": [(0, (0, 0), (3, 5)), (1, (0, 5), (3, 4)), (1, (3, 0), (3, 5)), (2, (3, 5), (3, 4))],
        "model.lm_head.weight": [(0, (0, 0), (3, 4)), (1, (3, 0), (3, 4)), (2, (6, 0), (2, 4))],
    }


def worker(rank, port, out, scale):
    torch_peer_world.join(rank, WORLD, port)
    full = full_tensors(scale)
    sd = {}
    for key, parts in blocks(scale).items():
        t = full[key]
        shards = []
        for owner, off, size in parts:
            if owner != rank:
                continue
            local = t[off[0]:off[0] + size[0], off[1]:off[1] + size[1]].contiguous()
            shards.append(Shard.from_tensor_and_offsets(local, list(off), rank))
        sd[key] = sharded_tensor.init_from_local_shards(shards, *t.shape)
    sd["model.norm"] = full["model.norm"]
    for key, layout in LAYOUT.items():
        sd[key] = layout(full[key])
    sd["optim.step"] = full["optim.step"]
    sd["extra.epoch"] = 3
    dcp.save_state_dict(sd, dcp.FileSystemWriter(os.path.join(out, "ckpt")))
    dist.barrier()
    dcp.save_state_dict(sd, dcp.FileSystemWriter(os.path.join(out, "ckpt_single"), single_file_per_rank=True))
    dist.barrier()
    dist.destroy_process_group()


def main(out, scale):
    os.makedirs(os.path.join(out, "raw"), exist_ok=True)
    store, port = torch_peer_world.serve()
    import torch.multiprocessing as mp
    mp.spawn(worker, args=(port, out, scale), nprocs=WORLD, join=True)
    del store
    full = full_tensors(scale)
    lines = []
    for key, t in full.items():
        b = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        with open(os.path.join(out, "raw", key + ".bin"), "wb") as f:
            f.write(b)
        shape = "[" + ",".join(str(d) for d in t.shape) + "]"
        lines.append(f"{key} {DTYPE[t.dtype]} {shape} {hashlib.sha256(b).hexdigest()}")
    with open(os.path.join(out, "digest.txt"), "w") as f:
        f.write("\n".join(sorted(lines)) + "\n")
    md = dcp.FileSystemReader(os.path.join(out, "ckpt")).read_metadata()
    shards = {}
    for key, m in md.state_dict_metadata.items():
        if isinstance(m, dcp.metadata.TensorStorageMetadata):
            shards[key] = [{"offsets": list(c.offsets), "sizes": list(c.sizes),
                            "file": md.storage_data[dcp.metadata.MetadataIndex(key, c.offsets)].relative_path}
                           for c in m.chunks]
    with open(os.path.join(out, "shards.json"), "w") as f:
        json.dump(shards, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)
