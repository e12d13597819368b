"""DCP chunks stored in another order of dimensions (torch.save keeps a tensor's strides: a
channels_last convolution weight, a transposed parameter), read by the tool and by torch itself,
side by side with the same tensors stored row-major, in one run (docs/FORMAT.md §5).

    /usr/bin/python3 bench/dcp_permuted.py TOOL [--quick] [--reps N] [--dir DIR]

TOOL is a built `shardsafe` (build/tools/shardsafe). The torch is /usr/bin/python3's (Debian 12's
1.13: plain tensors, written once; the same code runs on torch 2.x). Three models, each saved twice
by torch's DCP writer in one process: as laid out (channels_last / transposed) and row-major:
- conv: 16 convolution weights [512, 512, 3, 3] F32 (151 MB), channels_last: a run of 512
  elements per stored row;
- wide: one [2, 40M] F32 tensor (320 MB) stored transposed: the dimension stored innermost has
  2 elements, so the tool's windows (2^18 elements) cut it to one index: each window's runs gather
  every other element of the file (a run per tile of 2^16 chunk elements);
- tall: one [1030, 20000] F32 tensor (82 MB) stored transposed: stored rows of 1030 elements, a
  window of the full tensor's rows takes a piece of each (the tool's windows cover as much of
  the 1030 as 64 MiB allow: two windows, each stored row read twice; with 2^18-element windows it
  was read 79 times).
Rows, each in a fresh process, the checkpoint in the page cache: the tool's `unshard` into a
safetensors file (every tensor whole, written to page cache), torch's load of the same folder
into freshly allocated full tensors (1.13: FileSystemReader + load_state_dict(no_dist=True); 2.x:
dcp.load). Columns: median seconds of --reps rounds, peak RSS (torch's includes the interpreter
and torch), and the ratio against the row-major folder read by the tool, the limit this layout's
reader is held to. The two unshard outputs of each model must be byte for byte equal.
"""
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import torch_compat  # noqa: E402,F401  (torch 1.13 on Python 3.11, imported before torch)
from pybench import bench_args, peak_mib_of  # noqa: E402  (bench/pybench.py, beside this script)
try:
    import torch  # noqa: E402
except ImportError:
    print(f"dcp_permuted: skipped: {sys.executable} cannot import torch (Debian's python3-torch is the peer)")
    sys.exit(0)

TORCH2 = int(torch.__version__.split(".")[0]) >= 2


def save(sd, path):
    if TORCH2:
        import torch.distributed.checkpoint as dcp
        dcp.save(sd, checkpoint_id=path)  # no process group: one process, no communication
    else:
        import torch.distributed._shard.checkpoint as dcp
        dcp.save_state_dict(sd, dcp.FileSystemWriter(path), no_dist=True)


LOAD = r"""
import os, resource, sys, time
sys.path.insert(0, sys.argv[2])
import torch_compat
import torch
if int(torch.__version__.split(".")[0]) >= 2:
    import torch.distributed.checkpoint as dcp
    md = dcp.FileSystemReader(sys.argv[1]).read_metadata()
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()}
    t = time.perf_counter(); dcp.load(sd, checkpoint_id=sys.argv[1])
else:
    import torch.distributed._shard.checkpoint as dcp
    md = dcp.FileSystemReader(sys.argv[1]).read_metadata()
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()}
    t = time.perf_counter(); dcp.load_state_dict(sd, dcp.FileSystemReader(sys.argv[1]), no_dist=True)
print(time.perf_counter() - t)
"""


def warm(folder):
    for n in os.listdir(folder):
        with open(os.path.join(folder, n), "rb") as f:
            while f.read(1 << 24):
                pass


def main(argv):
    tool, quick, reps, base, tests = bench_args(argv, __doc__, "permuted")
    g = torch.Generator().manual_seed(3)
    n_conv, wide, tall = (2, 1_000_000, 2000) if quick else (16, 40_000_000, 20000)
    conv = {f"conv{i}": torch.randn(512, 512, 3, 3, generator=g) for i in range(n_conv)}
    models = {
        "conv": ({k: v.contiguous(memory_format=torch.channels_last) for k, v in conv.items()}, conv,
                 f"{n_conv} x [512,512,3,3] F32 channels_last"),
        "wide": ({"w": torch.randn(2, wide, generator=g).t().contiguous().t()}, None, f"[2,{wide}] F32 transposed"),
        "tall": ({"w": torch.randn(tall, 1030, generator=g).t()}, None, f"[1030,{tall}] F32 transposed"),
    }
    print(f"# dcp_permuted: torch {torch.__version__}, {reps} round(s), page cache; tool {tool}")
    print(f"{'model':<44} {'layout':<10} {'reader':<16} {'median s':>9} {'peak MiB':>9} {'x row-major':>12}")
    try:
        for name, (kept, plain, what) in models.items():
            plain = plain if plain is not None else {k: v.contiguous() for k, v in kept.items()}
            folders = {"kept": os.path.join(base, name + "_kept"), "row-major": os.path.join(base, name + "_rm")}
            save(kept, folders["kept"])
            save(plain, folders["row-major"])
            del kept, plain
            outs, limit = {}, None
            for layout in ("row-major", "kept"):
                folder = folders[layout]
                warm(folder)
                out = os.path.join(base, f"{name}_{layout}.safetensors")
                secs = []
                for _ in range(reps):
                    if os.path.exists(out):
                        os.unlink(out)
                    t = time.perf_counter()
                    subprocess.run([tool, "unshard", folder, out], check=True, stdout=subprocess.DEVNULL)
                    secs.append(time.perf_counter() - t)
                os.unlink(out)
                peak = peak_mib_of([tool, "unshard", folder, out])
                outs[layout] = out
                med = statistics.median(secs)
                limit = med if layout == "row-major" else limit
                print(f"{what:<44} {layout:<10} {'shardsafe':<16} {med:9.3f} {peak:9.1f} {med / limit:11.2f}x")
                tsecs = []
                for _ in range(reps):
                    r = subprocess.run([sys.executable, "-c", LOAD, folder, tests], check=True, capture_output=True)
                    tsecs.append(float(r.stdout.split()[-1]))
                tpeak = peak_mib_of([sys.executable, "-c", LOAD, folder, tests])
                tmed = statistics.median(tsecs)
                print(f"{what:<44} {layout:<10} {'torch load':<16} {tmed:9.3f} {tpeak:9.1f} {tmed / limit:11.2f}x")
            with open(outs["kept"], "rb") as a, open(outs["row-major"], "rb") as b:
                if a.read() != b.read():
                    sys.exit(f"dcp_permuted: {name}: the tool's unshard of the two layouts differ")
            for o in outs.values():
                os.unlink(o)
            for f in folders.values():
                shutil.rmtree(f)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
