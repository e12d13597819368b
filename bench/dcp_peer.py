"""The torch side of bench/bench_dcp.cpp, run by /usr/bin/python3: Debian 12's torch 1.13, or torch
2.x in the Debian 13 root of scripts/env-debian13.sh.

    python3 bench/dcp_peer.py version                         # the torch version
    python3 bench/dcp_peer.py write OUT HIDDEN VOCAB LAYERS   # a DCP checkpoint saved by 2 Gloo ranks
    python3 bench/dcp_peer.py load CKPT                       # torch's own load into full tensors
    python3 bench/dcp_peer.py save OUT HIDDEN VOCAB LAYERS    # torch 2.x: dcp.save of the full tensors, one process

`write` saves the benchmark model's shapes (bench_hf_export's: embedding, per layer qkv, o, up,
down and two norms; F32, seeded) chunked by rows over 2 ranks (torch 1.13: ShardedTensors; 2.x:
DTensors Shard(0), FSDP2's layout), keys `model.model.*` and `model.lm_head.weight` as a trainer
saving {"model": model.state_dict()} writes them, plus a non-tensor item; OUT/ckpt holds it and
OUT/digest.txt torch's SHA-256 of each full tensor (as `shardsafe digest` prints them).

`load` is the read half of the Python converters: torch 1.13's FileSystemReader +
load_state_dict(no_dist=True), torch 2.x's dcp.load (one process), into freshly allocated full
tensors. `save` is torch 2.x's dcp.save of the same tensors, whole, in one process (its
FileSystemWriter fsyncs every file: durable). Both print one line `seconds=S rss_before_mib=A
peak_rss_mib=P` (RSS after importing torch and, for save, making the tensors; peak RSS).
"""
import hashlib
import os
import resource
import sys
import time

# torch 1.13 on Python 3.11: tests/torch_compat.py, imported before torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import torch_compat  # noqa: E402,F401
import torch_peer_world  # noqa: E402
from pybench import rss_mib  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

TORCH2 = int(torch.__version__.split(".")[0]) >= 2
if TORCH2:
    import torch.distributed.checkpoint as dcp  # noqa: E402
else:
    import torch.distributed._shard.checkpoint as dcp  # noqa: E402
    from torch.distributed._shard import sharded_tensor  # noqa: E402
    from torch.distributed._shard.sharded_tensor import Shard  # noqa: E402

WORLD = 2


def shapes(h, vocab, layers):
    m = [("model.model.embed_tokens.weight", (vocab, h)), ("model.model.norm.weight", (h,)),
         ("model.lm_head.weight", (vocab, h))]
    for l in range(layers):
        p = f"model.model.layers.{l}."
        m += [(p + "attn.qkv.weight", (3 * h, h)), (p + "attn.o.weight", (h, h)), (p + "mlp.up.weight", (4 * h, h)),
              (p + "mlp.down.weight", (h, 4 * h)), (p + "norm1.weight", (h,)), (p + "norm2.weight", (h,))]
    return m


def tensor_of(i, shape):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(*shape, generator=g)


def worker(rank, port, out, h, vocab, layers):
    torch_peer_world.join(rank, WORLD, port)
    if TORCH2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard as DShard, distribute_tensor
        mesh = init_device_mesh("cpu", (WORLD,))
        sd = {key: distribute_tensor(tensor_of(i, shape), mesh, [DShard(0)])
              for i, (key, shape) in enumerate(shapes(h, vocab, layers))}
        sd["extra.step"] = 100
        dcp.save(sd, checkpoint_id=os.path.join(out, "ckpt"))
        dist.barrier()
        dist.destroy_process_group()
        return
    sd = {}
    for i, (key, shape) in enumerate(shapes(h, vocab, layers)):
        t = tensor_of(i, shape)
        rows = shape[0]
        a = (rows + 1) // 2
        lo, hi = (0, a) if rank == 0 else (a, rows)
        off = [lo] + [0] * (len(shape) - 1)
        sd[key] = sharded_tensor.init_from_local_shards([Shard.from_tensor_and_offsets(t[lo:hi].contiguous(), off, rank)], *shape)
    sd["extra.step"] = 100
    dcp.save_state_dict(sd, dcp.FileSystemWriter(os.path.join(out, "ckpt"), single_file_per_rank=True))
    dist.barrier()
    dist.destroy_process_group()


def write(out, h, vocab, layers):
    # the world's store bound here on a port the kernel picks, before the ranks start (a port
    # found free and closed again could be taken in between)
    store, port = torch_peer_world.serve()
    import torch.multiprocessing as mp
    mp.spawn(worker, args=(port, out, h, vocab, layers), nprocs=WORLD, join=True)
    del store
    lines = []
    for i, (key, shape) in enumerate(shapes(h, vocab, layers)):
        b = tensor_of(i, shape).reshape(-1).view(torch.uint8).numpy().tobytes()
        lines.append(f"{key} F32 [{','.join(str(d) for d in shape)}] {hashlib.sha256(b).hexdigest()}")
    with open(os.path.join(out, "digest.txt"), "w") as f:
        f.write("\n".join(sorted(lines)) + "\n")


def load(ckpt):
    before = rss_mib()
    t0 = time.perf_counter()
    reader = dcp.FileSystemReader(ckpt)
    md = reader.read_metadata()
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
          for k, m in md.state_dict_metadata.items() if isinstance(m, dcp.metadata.TensorStorageMetadata)}
    if TORCH2:
        import warnings
        warnings.simplefilter("ignore")
        dcp.load(sd, storage_reader=reader)
    else:
        dcp.load_state_dict(sd, reader, no_dist=True)
    secs = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"seconds={secs:.4f} rss_before_mib={before:.1f} peak_rss_mib={peak:.1f} tensors={len(sd)}")


def save(out, h, vocab, layers):
    sd = {key: tensor_of(i, shape) for i, (key, shape) in enumerate(shapes(h, vocab, layers))}
    before = rss_mib()
    import warnings
    warnings.simplefilter("ignore")
    t0 = time.perf_counter()
    dcp.save(sd, checkpoint_id=out)  # FileSystemWriter(sync_files=True): every file fsynced
    secs = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"seconds={secs:.4f} rss_before_mib={before:.1f} peak_rss_mib={peak:.1f} tensors={len(sd)}")


if __name__ == "__main__":
    if sys.argv[1] == "version":
        print(torch.__version__)
    elif sys.argv[1] == "write":
        write(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    elif sys.argv[1] == "save":
        save(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        load(sys.argv[2])
