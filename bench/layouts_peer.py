#!/usr/bin/env python3
"""The torch side of bench/bench_layouts.cpp (issue 57): writes one model (+ Adam's two moments)
in the layouts a user brings, and times the loads a Python user runs instead of shardsafe.

    python3 layouts_peer.py version
    python3 layouts_peer.py write OUT H VOCAB LAYERS      OUT/dcp (model + optimizer, dcp.save by 4
                                                          Gloo ranks, DTensor Shard(0): FSDP2's
                                                          layout), OUT/hf (the model, 2 safetensors
                                                          files + index), OUT/bin (the model, 2
                                                          torch.save files + index)
    python3 layouts_peer.py CASE DIR H VOCAB LAYERS       one timed load (below)

CASE:
  dcp_whole       dcp.load (one process, no world) into pre-allocated full tensors (touched first:
                  the model and optimizer exist), model + optimizer
  dcp_resharded   3 Gloo ranks, each dcp.load into its pre-allocated DTensor Shard(0) blocks (the
                  checkpoint's 4 blocks resharded); seconds = the slowest rank, from a barrier
  st_load_file    safetensors.torch.load_file of every file of OUT/hf (new tensors; they are mapped
                  from the file and read at first use, so a byte of every page is read in the time)
  st_into         load_file, then each tensor copied into the pre-allocated model (load_state_dict)
  bin_mmap        torch.load(mmap=True, weights_only=True) of every .bin, copied into the model
  bin_load        torch.load(weights_only=True) of every .bin (new tensors)

Every value is v(k, i) = ((i * 2654435761 + k * 40503 + 12345) mod 2^24) / 2^24 for tensor k of
the list below and flat element i: exact in F32, recomputed by bench_layouts on every byte it loads.
A load case prints "seconds=S peak_rss_mib=P rss_before_mib=B checked=N": S the load's wall
seconds (imports and allocation excluded), P the peak RSS (the sum over ranks for dcp_resharded),
N the tensors whose every value was checked against v after the timing. Exits 77 when torch is
older than 2.1 (no mmap load, no DTensor) or safetensors is missing.
"""
import json
import os
import resource
import sys
import time
import warnings

try:
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file
except ImportError as e:
    print(f"skipped: {e}")
    sys.exit(77)
if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 1):
    print(f"skipped: torch {torch.__version__} (needs 2.1: torch.load(mmap=True), DTensor)")
    sys.exit(77)
import torch.distributed.checkpoint as dcp  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import torch_peer_world  # noqa: E402
from pybench import rss_mib  # noqa: E402

warnings.simplefilter("ignore")
SAVE_WORLD, LOAD_WORLD = 4, 3


def params(h, vocab, layers):
    """The model's parameters (Hugging Face names, Llama-like shapes), in order."""
    m = [("model.embed_tokens.weight", (vocab, h))]
    for l in range(layers):
        p = f"model.layers.{l}."
        m += [(p + "self_attn.qkv_proj.weight", (3 * h, h)), (p + "self_attn.o_proj.weight", (h, h)),
              (p + "mlp.up_proj.weight", (4 * h, h)), (p + "mlp.down_proj.weight", (h, 4 * h)),
              (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    return m + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def train_state(h, vocab, layers):
    """The model and Adam's moments: (key, shape) with k = the position in this list."""
    ps = params(h, vocab, layers)
    return ps + [(f"optim.{n}.{m}", s) for m in ("exp_avg", "exp_avg_sq") for n, s in ps]


def values(k, begin, end):
    """v(k, i) for flat elements [begin, end) of tensor k."""
    i = torch.arange(begin, end, dtype=torch.int64)
    return ((i * 2654435761 + (k * 40503 + 12345)) % (1 << 24)).to(torch.float32) * (1.0 / (1 << 24))


def full(k, shape):
    n = 1
    for d in shape:
        n *= d
    return values(k, 0, n).reshape(shape)


def rows_of(rows, r, n):
    """torch.chunk's block of rank r of n on dimension 0 (DTensor Shard(0))."""
    c = (rows + n - 1) // n
    return min(rows, r * c), min(rows, r * c + c)


def block(k, shape, r, n):
    b, e = rows_of(shape[0], r, n)
    row = 1
    for d in shape[1:]:
        row *= d
    return values(k, b * row, e * row).reshape((e - b,) + tuple(shape[1:]))


def dtensors(state, mesh, r, n, fill):
    from torch.distributed.tensor import DTensor, Shard
    out = {}
    for k, (key, shape) in enumerate(state):
        local = block(k, shape, r, n) if fill else torch.zeros(block(k, shape, r, n).shape)
        out[key] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                      stride=torch.empty(shape, device="meta").stride())
    return out


def save_worker(rank, port, out, dims):
    torch_peer_world.join(rank, SAVE_WORLD, port)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (SAVE_WORLD,))
    dcp.save(dtensors(train_state(*dims), mesh, rank, SAVE_WORLD, True), checkpoint_id=os.path.join(out, "dcp"))
    leave()


def leave():
    """Ends a rank once every rank's work is done: without Gloo's teardown, which in torch 2.6 now
    and then leaves one worker waiting on a futex for good (tests/dcp2_check.py saw it too; so
    did this benchmark's smoke run in CI, a 4-rank write)."""
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def spawn(worker, n, *args):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store, port = torch_peer_world.serve()
    import torch.multiprocessing as mp
    mp.spawn(worker, args=(port,) + args, nprocs=n, join=True)
    del store


def write(out, dims):
    spawn(save_worker, SAVE_WORLD, out, dims)
    ps = params(*dims)
    half = (len(ps) + 1) // 2
    groups = [ps[:half], ps[half:]]
    for kind, name, index in (("hf", "model-{:05d}-of-00002.safetensors", "model.safetensors.index.json"),
                              ("bin", "pytorch_model-{:05d}-of-00002.bin", "pytorch_model.bin.index.json")):
        d = os.path.join(out, kind)
        os.makedirs(d, exist_ok=True)
        weight_map = {}
        k = 0
        for g, group in enumerate(groups):
            sd = {}
            for key, shape in group:
                sd[key] = full(k, shape)
                k += 1
            f = name.format(g + 1)
            if kind == "hf":
                save_file(sd, os.path.join(d, f), metadata={"format": "pt"})
            else:
                torch.save(sd, os.path.join(d, f))
            weight_map.update({key: f for key in sd})
        with open(os.path.join(d, index), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)


def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def check(state, got, r=None, n=None):
    """Every value of the first, the largest and the last tensor against v (after the timing)."""
    ks = sorted({0, len(state) - 1, max(range(len(state)), key=lambda k: torch.Size(state[k][1]).numel())})
    for k in ks:
        key, shape = state[k]
        want = full(k, shape) if r is None else block(k, shape, r, n)
        t = got[key]
        t = t.to_local() if hasattr(t, "to_local") else t
        if not torch.equal(t, want):
            sys.exit(f"{key}: the loaded values differ from v({k}, i)")
    return len(ks)


def report(secs, before, peak, checked):
    print(f"seconds={secs:.4f} peak_rss_mib={peak:.1f} rss_before_mib={before:.1f} checked={checked}")


def load_worker(rank, port, d, dims, out):
    torch_peer_world.join(rank, LOAD_WORLD, port)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (LOAD_WORLD,))
    state = train_state(*dims)
    sd = dtensors(state, mesh, rank, LOAD_WORLD, False)
    before = rss_mib()
    dist.barrier()
    t0 = time.perf_counter()
    dcp.load(sd, checkpoint_id=os.path.join(d, "dcp"))
    dist.barrier()
    secs = time.perf_counter() - t0
    checked = check(state, sd, rank, LOAD_WORLD)
    t = torch.tensor([peak_mib(), before], dtype=torch.float64)
    dist.all_reduce(t)
    if rank == 0:
        with open(out, "w") as f:
            f.write(f"{secs} {t[0].item()} {t[1].item()} {checked}")
    leave()


def load(case, d, dims):
    if case == "dcp_resharded":
        out = os.path.join(d, f"peer-{os.getpid()}.txt")
        spawn(load_worker, LOAD_WORLD, d, dims, out)
        with open(out) as f:
            secs, peak, before, checked = f.read().split()
        os.unlink(out)
        report(float(secs), float(before), float(peak), int(checked))
        return
    state = train_state(*dims) if case == "dcp_whole" else params(*dims)
    into = case in ("dcp_whole", "st_into", "bin_mmap")
    sd = {key: torch.zeros(shape) for key, shape in state} if into else {}
    before = rss_mib()
    if case == "dcp_whole":
        t0 = time.perf_counter()
        dcp.load(sd, checkpoint_id=os.path.join(d, "dcp"))  # no world: one process reads it all
    else:
        kind = "hf" if case.startswith("st_") else "bin"
        index = "model.safetensors.index.json" if kind == "hf" else "pytorch_model.bin.index.json"
        with open(os.path.join(d, kind, index)) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        t0 = time.perf_counter()
        for name in files:
            p = os.path.join(d, kind, name)
            got = (load_file(p) if kind == "hf" else
                   torch.load(p, mmap=(case == "bin_mmap"), weights_only=True, map_location="cpu"))
            if into:
                with torch.no_grad():
                    for key, t in got.items():
                        sd[key].copy_(t)
            else:
                if kind == "hf":  # mapped lazily: the load is not done until every page is read
                    for t in got.values():
                        t.reshape(-1).view(torch.uint8)[::4096].sum()
                sd.update(got)
            del got
    secs = time.perf_counter() - t0
    report(secs, before, peak_mib(), check(state, sd))


if __name__ == "__main__":
    if sys.argv[1] == "version":
        print(f"torch {torch.__version__}")
    elif sys.argv[1] == "write":
        write(sys.argv[2], tuple(int(x) for x in sys.argv[3:6]))
    else:
        load(sys.argv[1], sys.argv[2], tuple(int(x) for x in sys.argv[3:6]))
