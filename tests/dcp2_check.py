"""Loads a DCP folder that shardsafe wrote (tests/torch/test_dcp2.cpp: a model + AdamW of
examples/sharded_mlp.hpp saved by 3 C++ ranks in torch's get_state_dict layout) with torch 2.x's
own dcp.load and set_state_dict, and checks it bit for bit against the values the C++ ranks
gathered and wrote out beside it (REF/digest.txt, REF/raw/KEY.bin, REF/groups.json).

    python3 tests/dcp2_check.py CKPT REF single   # one process: dcp.load, set_state_dict, resume
    python3 tests/dcp2_check.py CKPT REF mesh     # 4 processes, DTensors on a 2 x 2 mesh

single: get_state_dict of a fresh model and AdamW (other learning rates), dcp.load, set_state_dict;
every parameter, every state tensor, the step counts and each group's hyper-parameters must equal
REF; then one AdamW step (fixed gradients) must equal the same step taken from a model and
optimizer built straight from REF's values (the resume is the uninterrupted run).
mesh: the model's parameters as DTensors [Replicate(), Shard(0)] (HSDP) and the second weight as
[Shard(0), Shard(1)] on a 2 x 2 mesh, AdamW state the same; after dcp.load every rank's local
pieces must equal REF cut by torch's own distribute_tensor.
Prints "ok" and exits 0, or names what differs and exits 1.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

import torch_peer_world

DTYPE = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16, "BF16": torch.bfloat16,
         "I64": torch.int64, "BOOL": torch.bool}


class MLP(torch.nn.Module):
    """examples/sharded_mlp.hpp's model: layers.0 (24 -> 48), norm (48), layers.1 (48 -> 24)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(24, 48), torch.nn.Linear(48, 24)])
        self.norm = torch.nn.LayerNorm(48)


def reference(ref):
    out = {}
    with open(os.path.join(ref, "digest.txt")) as f:
        for line in f:
            key, dt, shape, _ = line.split()
            dims = [int(d) for d in shape[1:-1].split(",") if d]
            with open(os.path.join(ref, "raw", key + ".bin"), "rb") as g:
                b = bytearray(g.read())
            t = torch.frombuffer(b, dtype=DTYPE[dt]) if b else torch.empty(0, dtype=DTYPE[dt])
            out[key] = t.reshape(dims).clone()
    with open(os.path.join(ref, "groups.json")) as f:
        groups = json.load(f)
    return out, groups


def make_optimizer(model, groups, lr_scale):
    """AdamW over REF's groups (the same parameters, in the same order); lr scaled (a wrong lr that
    set_state_dict must replace)."""
    named = dict(model.named_parameters())
    pg = []
    for g in groups:
        pg.append({"params": [named[n] for n in g["params"]], "lr": g["lr"] * lr_scale})
    g0 = groups[0]
    return torch.optim.AdamW(pg, betas=tuple(g0["betas"]), eps=g0["eps"], weight_decay=g0["weight_decay"],
                             amsgrad=g0["amsgrad"])


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                       b.contiguous().reshape(-1).view(torch.uint8))


def check_single(ckpt, ref):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    want, groups = reference(ref)
    model = MLP()
    opt = make_optimizer(model, groups, lr_scale=7.0)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    bad = []
    for n, p in model.named_parameters():
        if not same(want["model." + n], p.detach()):
            bad.append("model." + n)
        for k, v in opt.state[p].items():
            if not same(want["optim.state." + n + "." + k], v):
                bad.append("optim.state." + n + "." + k)
    for g, w in zip(opt.param_groups, groups):
        for k in ("lr", "eps", "weight_decay", "amsgrad"):
            if g[k] != w[k]:
                bad.append(f"param group {k}: {g[k]} != {w[k]}")
        if tuple(g["betas"]) != tuple(w["betas"]):
            bad.append("param group betas")
    if bad:
        print("differs from the C++ ranks' values:", ", ".join(bad))
        return 1
    # resume: one step from the loaded state == one step from REF's state built directly
    direct = MLP()
    with torch.no_grad():
        for n, p in direct.named_parameters():
            p.copy_(want["model." + n])
    dopt = make_optimizer(direct, groups, lr_scale=1.0)
    for n, p in direct.named_parameters():
        dopt.state[p] = {k: want["optim.state." + n + "." + k].clone()
                         for k in ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")}
    g = torch.Generator().manual_seed(3)
    grads = {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
    for m, o in ((model, opt), (direct, dopt)):
        for n, p in m.named_parameters():
            p.grad = grads[n].clone()
        o.step()
    for (n, p), (_, q) in zip(model.named_parameters(), direct.named_parameters()):
        if not same(q.detach(), p.detach()) or not same(dopt.state[q]["exp_avg"], opt.state[p]["exp_avg"]):
            print("the resumed step differs from the uninterrupted one at", n)
            return 1
    if float(opt.state[model.layers[0].weight]["step"]) != float(want["optim.state.layers.0.weight.step"]) + 1:
        print("the step count did not move on by one")
        return 1
    print("ok")
    return 0


def mesh_worker(rank, port, ckpt, ref, results):
    torch_peer_world.join(rank, 4, port)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.checkpoint.state_dict import get_state_dict
    want, groups = reference(ref)
    mesh = init_device_mesh("cpu", (2, 2))
    placements = {n: ([Shard(0), Shard(1)] if n == "layers.1.weight" else [Replicate(), Shard(0)])
                  for n in ("layers.0.weight", "layers.0.bias", "norm.weight", "norm.bias", "layers.1.weight",
                            "layers.1.bias")}
    model = MLP()
    for n in placements:
        mod, leaf = n.rsplit(".", 1)
        sub = model.get_submodule(mod)
        setattr(sub, leaf, torch.nn.Parameter(distribute_tensor(torch.zeros_like(getattr(sub, leaf)), mesh, placements[n])))
    opt = make_optimizer(model, groups, lr_scale=3.0)
    for n, p in model.named_parameters():  # the state AdamW makes on its first step, as DTensors
        z = distribute_tensor(torch.zeros(p.shape), mesh, placements[n])
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": z.clone(), "exp_avg_sq": z.clone(), "max_exp_avg_sq": z.clone()}
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    bad = []
    for n in placements:
        if not same(distribute_tensor(want["model." + n], mesh, placements[n]).to_local(), msd[n].to_local()):
            bad.append("model." + n)
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            got = osd["state"][n][k]
            if not same(distribute_tensor(want["optim.state." + n + "." + k], mesh, placements[n]).to_local(), got.to_local()):
                bad.append(f"optim.state.{n}.{k}")
        if not same(want["optim.state." + n + ".step"], osd["state"][n]["step"]):
            bad.append(f"optim.state.{n}.step")
    results.put((rank, bad))
    dist.barrier()
    # every rank's result is in: leave without Gloo's teardown, which once left one of the four
    # workers waiting on a futex for good in torch 2.6 (the test then waited on it until killed)
    sys.stdout.flush()
    os._exit(0)


def check_mesh(ckpt, ref):
    import torch.multiprocessing as mp
    store, port = torch_peer_world.serve()
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.spawn(mesh_worker, args=(port, ckpt, ref, q), nprocs=4, join=True)
    del store
    bad = []
    for _ in range(4):
        rank, b = q.get()
        bad += [f"rank {rank}: {x}" for x in b]
    if bad:
        print("differs from the C++ ranks' values:", ", ".join(bad))
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    ckpt, ref, mode = sys.argv[1:4]
    sys.exit(check_single(ckpt, ref) if mode == "single" else check_mesh(ckpt, ref))
