"""torch.distributed.checkpoint folders as torch 2.x writes them, from a 4-process Gloo world of
DTensors (Debian 13's torch 2.6, in the root of scripts/env-debian13.sh), for the torch 2.x interop
tests (tests/torch/test_dcp2.cpp) and the golden fixtures (tests/fixtures/dcp_torch2/).

    python3 tests/dcp2_fixture.py OUT_DIR [--small]

OUT_DIR/ckpt/ is dcp.save({"model": ..., "optim": ..., "extra": ...}) of
- a model, nn.Sequential(Linear(6, 7), Linear(7, 3)), trained two AdamW steps (lr 0.01, betas
  (0.9, 0.95), eps 1e-8, weight_decay 0.1) alike in every rank, whose parameters and AdamW state
  are then made DTensors Shard(0) on a 1-D mesh of 4, FSDP2's layout (torch.chunk pieces: 7 rows
  as 2, 2, 2, 1; the 3-element bias as 1, 1, 1 and an empty piece), taken by get_state_dict;
- extra: grid F32 [6, 9] on a 2 x 2 mesh [Shard(0), Shard(1)]; hsdp BF16 [10, 4] [Replicate(),
  Shard(0)] (replicas the planner writes once); half F16 [5, 3] Shard(1); ids I64 [9] Shard(0);
  mask BOOL [3, 5] Shard(0) (an empty piece); experts F32 [4, 3, 2] on an ("ep", "ep_fsdp") mesh
  [Shard(0), Shard(1)]; chunks whose data files keep another order of dimensions, as torch.save
  keeps a tensor's strides: conv F32 [8, 5, 3, 3] Shard(0) and conv_cols BF16 [4, 8, 3, 3]
  Shard(1), their local pieces channels_last; tied BF16 [8, 6] on the 2 x 2 mesh, its pieces
  transposed; whole_t F16 [3, 5], a plain transposed tensor; and the non-tensor items epoch (7)
  and name ("run-a").
OUT_DIR/ckpt_adam/ and OUT_DIR/ckpt_sgd/ hold the same model trained two steps of Adam and of SGD
with momentum (model and optim only). --small writes ckpt alone, of a smaller state (Linear(4, 3),
grid [4, 4], hsdp [4, 2], mask [3, 2], conv [4, 3, 2, 2], tied [4, 6], whole_t [3, 5], epoch): the
golden fixtures of tests/fixtures/dcp_torch2/.

Beside them, torch's own values: OUT_DIR/digest.txt (`KEY DTYPE [SHAPE] SHA256`, sorted, a line
per tensor of ckpt, as `shardsafe digest` prints) and raw/KEY.bin (each full tensor's bytes,
row-major, as tests/support/dcp_digest.hpp reads them); raw_adam/, raw_sgd/ the same for the other two;
groups.json each checkpoint's param groups as get_state_dict gave them.
"""
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist

import torch_peer_world

WORLD = 4
DTYPE = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
         torch.int64: "I64", torch.bool: "BOOL"}


SMALL = False  # --small: the golden fixtures' smaller state (set in main)


def make_model():
    torch.manual_seed(5)
    if SMALL:
        return torch.nn.Sequential(torch.nn.Linear(4, 3))
    return torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Linear(7, 3))


def make_optim(kind, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.02, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.0)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True)


def trained(kind):
    """The model and optimizer after two steps, alike in every process."""
    m = make_model()
    opt = make_optim(kind, m.parameters())
    g = torch.Generator().manual_seed(9)
    n_in = m[0].in_features
    x, y = torch.randn(8, n_in, generator=g), torch.randn(8, 3, generator=g)
    for _ in range(2):
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def extras():
    g = torch.Generator().manual_seed(11)
    if SMALL:
        e = {
            "grid": torch.randn(4, 4, generator=g),
            "hsdp": torch.randn(4, 2, generator=g).to(torch.bfloat16),
            "mask": torch.rand(3, 2, generator=g) > 0.5,
        }
        e.update({  # drawn after the others, which keep their values
            "conv": torch.randn(4, 3, 2, 2, generator=g),
            "tied": torch.randn(4, 6, generator=g).to(torch.bfloat16),
            "whole_t": torch.randn(5, 3, generator=g).to(torch.float16).t(),
        })
        return e
    return {
        "grid": torch.randn(6, 9, generator=g),
        "hsdp": torch.randn(10, 4, generator=g).to(torch.bfloat16),
        "half": torch.randn(5, 3, generator=g).to(torch.float16),
        "ids": torch.randint(-1000, 1000, (9,), generator=g, dtype=torch.int64),
        "mask": torch.rand(3, 5, generator=g) > 0.5,
        "experts": torch.randn(4, 3, 2, generator=g),
        "conv": torch.randn(8, 5, 3, 3, generator=g),
        "conv_cols": torch.randn(4, 8, 3, 3, generator=g).to(torch.bfloat16),
        "tied": torch.randn(8, 6, generator=g).to(torch.bfloat16),
        "whole_t": torch.randn(5, 3, generator=g).to(torch.float16).t(),
    }


def channels_last(t):
    return t.contiguous(memory_format=torch.channels_last)


def transposed(t):
    return t.t().contiguous().t()


def kept_layout(full, mesh, placements, layout):
    """A DTensor whose local pieces have `layout`'s strides (channels_last, transposed), as a model
    trained in that memory format holds them: torch.save keeps them in the data files."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    local = layout(distribute_tensor(full, mesh, placements).to_local())
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def reference(kind):
    """key -> full tensor, as the checkpoint of `kind` holds them (torch's own values)."""
    m, opt = trained(kind)
    names = {p: n for n, p in m.named_parameters()}
    out = {"model." + n: p.detach().clone() for n, p in m.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out["optim.state." + names[p] + "." + k] = v.detach().clone()
    return out


def distributed_state(kind, mesh):
    """get_state_dict of the trained model whose parameters and state are DTensors Shard(0)."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.checkpoint.state_dict import get_state_dict
    m, opt = trained(kind)
    old = {n: (p, opt.state[p]) for n, p in m.named_parameters()}
    for n, _ in list(m.named_parameters()):
        mod_name, leaf = n.rsplit(".", 1)
        mod = m.get_submodule(mod_name)
        setattr(mod, leaf, torch.nn.Parameter(distribute_tensor(getattr(mod, leaf).detach(), mesh, [Shard(0)])))
    new_opt = make_optim(kind, m.parameters())
    for n, p in m.named_parameters():
        st = {}
        for k, v in old[n][1].items():
            st[k] = v.clone() if v.dim() == 0 else distribute_tensor(v.detach(), mesh, [Shard(0)])
        new_opt.state[p] = st
    return get_state_dict(m, new_opt)


def worker(rank, port, out, small):
    global SMALL
    SMALL = small
    torch_peer_world.join(rank, WORLD, port)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh1 = init_device_mesh("cpu", (WORLD,))
    mesh2 = init_device_mesh("cpu", (2, 2))
    ep = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "ep_fsdp"))
    for kind in (["adamw"] if small else ["adamw", "adam", "sgd"]):
        msd, osd = distributed_state(kind, mesh1)
        sd = {"model": msd, "optim": osd}
        if kind == "adamw" and SMALL:
            e = extras()
            sd["extra"] = {
                "grid": distribute_tensor(e["grid"], mesh2, [Shard(0), Shard(1)]),
                "hsdp": distribute_tensor(e["hsdp"], mesh2, [Replicate(), Shard(0)]),
                "mask": distribute_tensor(e["mask"], mesh1, [Shard(0)]),
                "conv": kept_layout(e["conv"], mesh1, [Shard(0)], channels_last),
                "tied": kept_layout(e["tied"], mesh2, [Shard(0), Shard(1)], transposed),
                "whole_t": e["whole_t"],
                "epoch": 7,
            }
        elif kind == "adamw":
            e = extras()
            sd["extra"] = {
                "grid": distribute_tensor(e["grid"], mesh2, [Shard(0), Shard(1)]),
                "hsdp": distribute_tensor(e["hsdp"], mesh2, [Replicate(), Shard(0)]),
                "half": distribute_tensor(e["half"], mesh1, [Shard(1)]),
                "ids": distribute_tensor(e["ids"], mesh1, [Shard(0)]),
                "mask": distribute_tensor(e["mask"], mesh1, [Shard(0)]),
                "experts": distribute_tensor(e["experts"], ep, [Shard(0), Shard(1)]),
                "conv": kept_layout(e["conv"], mesh1, [Shard(0)], channels_last),
                "conv_cols": kept_layout(e["conv_cols"], mesh1, [Shard(1)], channels_last),
                "tied": kept_layout(e["tied"], mesh2, [Shard(0), Shard(1)], transposed),
                "whole_t": e["whole_t"],
                "epoch": 7,
                "name": "run-a",
            }
        folder = "ckpt" if kind == "adamw" else "ckpt_" + kind
        dcp.save(sd, checkpoint_id=os.path.join(out, folder))
        if rank == 0:
            groups = [{k: v for k, v in g.items()} for g in osd["param_groups"]]
            with open(os.path.join(out, "groups_" + kind + ".json"), "w") as f:
                json.dump(groups, f, sort_keys=True)
    dist.barrier()
    dist.destroy_process_group()


def write_reference(out, raw_dir, tensors, digest_name):
    os.makedirs(os.path.join(out, raw_dir), exist_ok=True)
    lines = []
    for key, t in tensors.items():
        b = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        with open(os.path.join(out, raw_dir, key + ".bin"), "wb") as f:
            f.write(b)
        shape = "[" + ",".join(str(d) for d in t.shape) + "]"
        lines.append(f"{key} {DTYPE[t.dtype]} {shape} {hashlib.sha256(b).hexdigest()}")
    with open(os.path.join(out, digest_name), "w") as f:
        f.write("\n".join(sorted(lines)) + "\n")


def main(out, small):
    global SMALL
    SMALL = small
    os.makedirs(out, exist_ok=True)
    import torch.multiprocessing as mp
    store, port = torch_peer_world.serve()
    mp.spawn(worker, args=(port, out, small), nprocs=WORLD, join=True)
    del store
    ref = reference("adamw")
    ref.update({"extra." + k: v for k, v in extras().items()})
    write_reference(out, "raw", ref, "digest.txt")
    if small:
        import shutil
        shutil.rmtree(os.path.join(out, "raw"))
    else:
        for kind in ("adam", "sgd"):
            write_reference(os.path.join(out, "ckpt_" + kind + "_ref"), "raw", reference(kind), "digest.txt")


if __name__ == "__main__":
    main(sys.argv[1], "--small" in sys.argv[2:])
