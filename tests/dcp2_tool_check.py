"""The tool's to-dcp output read by torch 2.x itself (tests/torch/test_dcp2.cpp).

    python3 tests/dcp2_tool_check.py hf OUT          # an HF folder made here: OUT/hf, OUT/hf_raw/KEY.bin
    python3 tests/dcp2_tool_check.py check DCP RAW   # dcp.load every tensor of DCP; each must equal RAW/KEY.bin
    python3 tests/dcp2_tool_check.py train PT DCP    # DCP (to-dcp of the torch.save file PT) is torch's dcp.save of it
    python3 tests/dcp2_tool_check.py train_values PT DCP  # the same, loaded with weights_only=False

hf: two safetensors shards and their index, written by Python's safetensors (F32, BF16, F16, I64,
BOOL, a 0-d and an empty tensor), and every tensor's row-major bytes beside them.
check: torch's own reader (dcp.load in one process, into tensors allocated from the folder's
metadata) loads every tensor of DCP; every one must equal RAW/KEY.bin bit for bit, every file of
RAW must be a tensor of DCP. Prints "ok N tensors" and exits 0, or names what differs.
train: torch's own dcp.save of torch.load(PT) (one process) is the reference: the same keys, each
a tensor of the same dtype and size or a value, the same planner_data, and the nested state
dicts torch's dcp_to_torch_save makes of the two folders equal (types, values, tensors' bytes;
a dict's keys in any order: the tool writes them in name order, torch in its dict's).
Prints "ok N keys", or names what differs.
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


def same(a, b, where, bad):
    """a and b equal: the same types all through, tensors of the same dtype, shape and bytes, dicts
    of the same keys (in any order)."""
    if type(a) is not type(b):
        bad.append("%s: %s against %s" % (where, type(a).__name__, type(b).__name__))
    elif isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape or raw_bytes(a) != raw_bytes(b):
            bad.append(where + ": tensors differ")
    elif isinstance(a, dict):
        if sorted(a) != sorted(b):  # a dict's order is not compared: the tool writes keys in name order
            bad.append("%s: keys %s against %s" % (where, sorted(a), sorted(b)))
        for k in a:
            if k in b:
                same(a[k], b[k], "%s.%s" % (where, k), bad)
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            bad.append("%s: %d items against %d" % (where, len(a), len(b)))
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, "%s.%d" % (where, i), bad)
    elif a != b and not (a != a and b != b):
        bad.append("%s: %r against %r" % (where, a, b))


def item_pickles(folder):
    """The data.pkl of each bytes item of DCP folder FOLDER (a torch.save archive), by key."""
    import io
    import zipfile
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    md = dcp.FileSystemReader(folder).read_metadata()
    out = {}
    for idx, info in md.storage_data.items():
        if isinstance(md.state_dict_metadata[idx.fqn], BytesStorageMetadata):
            with open(os.path.join(folder, info.relative_path), "rb") as f:
                f.seek(info.offset)
                z = zipfile.ZipFile(io.BytesIO(f.read(info.length)))
            out[idx.fqn] = z.read([n for n in z.namelist() if n.endswith("/data.pkl")][0])
    return out


def check_train(pt, folder, weights_only=True):
    """FOLDER (the tool's to-dcp of the torch.save file PT) against torch's own dcp.save of
    torch.load(PT): the same keys, each a tensor (its dtype and size) or a value alike, the same
    planner_data; and the state dicts torch's dcp_to_torch_save makes of the two are equal.
    weights_only=False: PT and the two state dicts are read so (values torch's weights_only
    unpickler refuses: a set or frozenset as protocol 2 writes it); then each bytes item's
    data.pkl is also compared with torch's, less its memo PUTs (pickletools.optimize), and how
    many are the same bytes is printed."""
    import pickletools
    import tempfile
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    tmp = tempfile.mkdtemp()
    ref = os.path.join(tmp, "ref")
    dcp.save(torch.load(pt, weights_only=weights_only), checkpoint_id=ref)  # no process group: one process
    ours_md, ref_md = (dcp.FileSystemReader(d).read_metadata() for d in (folder, ref))
    bad = []
    a, b = ours_md.state_dict_metadata, ref_md.state_dict_metadata
    if set(a) != set(b):
        bad.append("keys differ: only the tool's %s, only torch's %s" % (sorted(set(a) - set(b)), sorted(set(b) - set(a))))
    for k in sorted(set(a) & set(b)):
        ta, tb = isinstance(a[k], TensorStorageMetadata), isinstance(b[k], TensorStorageMetadata)
        if ta != tb or (ta and (a[k].size != b[k].size or a[k].properties.dtype != b[k].properties.dtype)):
            bad.append(k + ": the item differs: %r against %r" % (a[k], b[k]))
    if ours_md.planner_data != ref_md.planner_data:
        bad.append("planner_data differs: %r against %r" % (ours_md.planner_data, ref_md.planner_data))
    back = []
    for d in (folder, ref):
        dcp_to_torch_save(d, d + ".pt")
        back.append(torch.load(d + ".pt", weights_only=weights_only))
    same(back[0], back[1], "state dict", bad)
    identical = ""
    if not weights_only:
        ours, theirs = item_pickles(folder), item_pickles(ref)
        n = sum(ours[k] == pickletools.optimize(theirs[k]) for k in ours if k in theirs)
        identical = ", %d of %d items' data.pkl the same bytes as torch's less its memo PUTs" % (n, len(theirs))
    if bad:
        print("\n".join(bad))
        return 1
    print("ok %d keys%s" % (len(a), identical))
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "hf":
        make_hf(sys.argv[2])
        sys.exit(0)
    if sys.argv[1] == "train":
        sys.exit(check_train(sys.argv[2], sys.argv[3]))
    if sys.argv[1] == "train_values":  # weights_only=False: sets and frozensets as protocol 2 writes them
        sys.exit(check_train(sys.argv[2], sys.argv[3], weights_only=False))
    sys.exit(check(sys.argv[2], sys.argv[3]))
