"""A Hugging Face folder in the torch.save layout (pytorch_model.bin, docs/FORMAT.md §3)
converted to safetensors: by the tool, by what a Python user runs instead (torch.load, then
safetensors' save_file where Python has it, else the same file written here), and `cp` of the
file, the floor of any conversion that reads and writes every byte, in one run.

    /usr/bin/python3 bench/torch_bin.py TOOL [--quick] [--reps N] [--dir DIR]

TOOL is a built `shardsafe` (build/tools/shardsafe). The torch is /usr/bin/python3's (Debian 12's
1.13; the same code runs on torch 2.x). Two folders, each written by torch.save in its zip
format and in its legacy one (torch < 1.6, `_use_new_zipfile_serialization=False`):
- large: 32 BF16 tensors [4096, 4096] and a tied embedding (one storage, two names): 1 GiB;
- many: 40,000 F32 tensors of 16 elements (2.6 MB): the cost per tensor (the tool's loads each
  walked every tensor name before `load_options::list_unexpected`: 71 s for this folder).
Rows, each in a fresh process, the input in the page cache, the output written to page cache:
median seconds of --reps rounds (the tool's and cp's whole process; the peer's from torch.load
on, its interpreter's start and torch's import left out), peak RSS (the Python peer's includes the interpreter and
torch), and the ratio against `cp`. The tool's output and the peer's must hold the same tensors
byte for byte (compared here by name, dtype, shape and bytes).
"""
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import torch_compat  # noqa: E402,F401  (torch 1.13 on Python 3.11, imported before torch)
from pybench import bench_args, peak_mib_of  # noqa: E402  (bench/pybench.py, beside this script)
try:
    import torch  # noqa: E402
except ImportError:
    print(f"torch_bin: skipped: {sys.executable} cannot import torch (Debian's python3-torch is the peer)")
    sys.exit(0)

# the peer: load every tensor with torch, write them as safetensors (safetensors' own writer
# where Python has it: Debian 13; else a writer of the same format here)
PEER = r"""
import json, os, struct, sys, time
sys.path.insert(0, sys.argv[3])
import torch_compat
import torch
t = time.perf_counter()
sd = torch.load(sys.argv[1], map_location="cpu")
try:
    from safetensors.torch import save_file
    seen = {}
    for k, v in sd.items():  # safetensors refuses shared storages: clone the second name
        p = v.storage().data_ptr()
        sd[k] = v.clone() if p in seen else v.contiguous()
        seen[p] = k
    save_file(sd, sys.argv[2])
except ImportError:
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
    header, at, blobs = {}, 0, []
    for k in sorted(sd):
        b = sd[k].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[k] = {"dtype": names[sd[k].dtype], "shape": list(sd[k].shape), "data_offsets": [at, at + len(b)]}
        at += len(b)
        blobs.append(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(sys.argv[2], "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)
print(time.perf_counter() - t)
"""


def tensors_of(path):
    """name -> (dtype, shape, bytes) of a safetensors file, read here."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in header.items()}


def timed(args, reps, out, own_clock=False):
    """Median seconds of reps runs of args: the process's wall time, or (own_clock) the seconds
    it prints last (the Python peer's, without its interpreter's start and torch's import)."""
    secs = []
    for _ in range(reps):
        if os.path.isdir(out):
            shutil.rmtree(out)
        elif os.path.exists(out):
            os.unlink(out)
        t = time.perf_counter()
        r = subprocess.run(args, check=True, capture_output=True)
        secs.append(float(r.stdout.split()[-1]) if own_clock else time.perf_counter() - t)
    return statistics.median(secs)


def main(argv):
    tool, quick, reps, base, tests = bench_args(argv, __doc__, "torch-bin")
    g = torch.Generator().manual_seed(5)
    n_big, n_many = (2, 2000) if quick else (32, 40000)
    embed = torch.randn(4096, 4096, generator=g).to(torch.bfloat16)
    large = {f"layers.{i}.weight": torch.randn(4096, 4096, generator=g).to(torch.bfloat16) for i in range(n_big)}
    large.update({"embed.weight": embed, "lm_head.weight": embed})
    many = {f"layers.{i}.scale": torch.randn(16, generator=g) for i in range(n_many)}
    print(f"# torch_bin: torch {torch.__version__}, {reps} round(s), page cache; tool {tool}")
    print(f"{'folder':<40} {'converter':<28} {'median s':>9} {'peak MiB':>9} {'x cp':>7}")
    try:
        for name, sd, what, kw in ((n + f, sd, w + " " + f, kw)
                                   for n, sd, w in (("large", large, f"{n_big + 1} x [4096,4096] BF16 + tied"),
                                                    ("many", many, f"{n_many} x [16] F32"))
                                   for f, kw in (("zip", {}), ("legacy", {"_use_new_zipfile_serialization": False}))):
            folder = os.path.join(base, name)
            os.makedirs(folder)
            src = os.path.join(folder, "pytorch_model.bin")
            torch.save(sd, src, **kw)
            with open(src, "rb") as f:
                while f.read(1 << 24):
                    pass
            cp_out = os.path.join(base, "cp.bin")
            cp = timed(["cp", src, cp_out], reps, cp_out)
            cp_peak = peak_mib_of(["cp", src, cp_out])
            os.unlink(cp_out)
            print(f"{what:<40} {'cp (the floor)':<28} {cp:9.3f} {cp_peak:9.1f} {1.0:6.2f}x")
            out = os.path.join(base, name + "-hf")
            med = timed([tool, "to-hf", folder, out], reps, out)
            shutil.rmtree(out)
            peak = peak_mib_of([tool, "to-hf", folder, out])
            print(f"{what:<40} {'shardsafe to-hf':<28} {med:9.3f} {peak:9.1f} {med / cp:6.2f}x")
            peer_out = os.path.join(base, name + ".safetensors")
            pmed = timed([sys.executable, "-c", PEER, src, peer_out, tests], reps, peer_out, own_clock=True)
            os.unlink(peer_out)
            ppeak = peak_mib_of([sys.executable, "-c", PEER, src, peer_out, tests])
            print(f"{what:<40} {'torch.load + safetensors':<28} {pmed:9.3f} {ppeak:9.1f} {pmed / cp:6.2f}x")
            if tensors_of(os.path.join(out, "model.safetensors")) != tensors_of(peer_out):
                sys.exit(f"torch_bin: {name}: the tool's safetensors and the peer's hold different tensors")
            shutil.rmtree(out)
            os.unlink(peer_out)
            shutil.rmtree(folder)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
