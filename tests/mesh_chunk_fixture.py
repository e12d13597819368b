"""Each rank's piece of a tensor on a device mesh, computed with torch's own torch.chunk (Debian's
torch 1.13 under /usr/bin/python3), for tests/shard/test_mesh.cpp.

    python3 tests/mesh_chunk_fixture.py CASES_FILE

CASES_FILE has one case a line: "SHAPE;MESH;PLACEMENTS", e.g. "10,6;2,3;r,s0" (a [10,6]
tensor on a [2,3] mesh, Replicate() then Shard(0)). torch 1.13 has no DTensor, so its nesting is
emulated: the tensor torch.arange(numel).reshape(SHAPE) is cut along the mesh dimensions from
left to right, each Shard(d) taking torch.chunk(piece, mesh[m], dim=d)[coord] (an empty piece
when torch.chunk returns fewer pieces than ranks, as DTensor pads), each Replicate() keeping
the piece whole. For every case and rank (row-major coordinates) one line is printed:

    CASE RANK empty
    CASE RANK LOCAL_SHAPE GLOBAL_OFFSET SHA256

where the shape and offset are comma-separated (the offset is the multi-index of the piece's
first element, found from its value) and SHA256 is that of the piece's values (the global flat
indices of its elements, in its own row-major order) as little-endian int64.
"""
import hashlib
import os
import struct
import sys

# torch 1.13 on Python 3.11: tests/torch_compat.py, imported before torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_compat  # noqa: E402,F401
import torch  # noqa: E402


def ints(text):
    return [int(x) for x in text.split(",")] if text else []


def unravel(i, shape):
    idx = []
    for n in reversed(shape):
        idx.append(i % n)
        i //= n
    return list(reversed(idx))


def main(path):
    with open(path) as f:
        cases = [line.strip() for line in f if line.strip()]
    for case, line in enumerate(cases):
        shape_s, mesh_s, pl_s = line.split(";")
        shape, mesh, pls = ints(shape_s), ints(mesh_s), pl_s.split(",")
        numel = 1
        for n in shape:
            numel *= n
        full = torch.arange(numel, dtype=torch.int64).reshape(shape)
        ranks = 1
        for n in mesh:
            ranks *= n
        for rank in range(ranks):
            coords = unravel(rank, mesh)
            t = full
            for m, p in enumerate(pls):
                if p == "r":
                    continue
                d = int(p[1:])
                pieces = torch.chunk(t, mesh[m], dim=d)
                t = pieces[coords[m]] if coords[m] < len(pieces) else t.narrow(d, 0, 0)
            if t.numel() == 0:
                print(case, rank, "empty")
                continue
            values = t.contiguous().reshape(-1).tolist()
            digest = hashlib.sha256(struct.pack("<%dq" % len(values), *values)).hexdigest()
            offset = unravel(values[0], shape)
            print(case, rank, ",".join(map(str, t.shape)), ",".join(map(str, offset)), digest)


if __name__ == "__main__":
    main(sys.argv[1])
