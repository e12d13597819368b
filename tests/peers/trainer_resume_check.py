#!/usr/bin/env python3
"""A torch training run resumed from `shardsafe to-dcp` of a trainer's checkpoint (issue 54):
torch's own get_state_dict / dcp.load / set_state_dict take the exported folder, and the run
continues exactly as AdamW continues from the trainer's own tensors.

    /usr/bin/python3 tests/peers/trainer_resume_check.py TOOL [tests/fixtures/peers]

For each DeepSpeed golden whose model a plain torch module can hold (zero2_fp32: fp32 weights;
zero3_bf16 and its universal checkpoint: the fp32 masters are the parameters), the module is made
from the golden's expected/ names and shapes (trainable parameters: expected/fp32.safetensors;
the rest, buffers and the frozen parameter, as buffers), with torch.optim.AdamW grouped as the
peer grouped it (tests/peers/ds_peer.py: 2-D weights with weight decay 0.01, the rest 0.0,
lr 1e-2). Then:
  1. `shardsafe to-dcp CKPT OUT`;
  2. get_state_dict(model, optimizer), dcp.load of OUT into it, set_state_dict: every parameter and
     Adam's exp_avg, exp_avg_sq and step must equal the trainer's own (expected/, written by
     DeepSpeed 0.19.5's live engine), bit for bit;
  3. one more AdamW step with the gradient of DeepSpeed's own resumed step (expected/resume/,
     tests/peers/ds_peer.py): parameters, exp_avg and exp_avg_sq equal DeepSpeed's state after
     its step, bit for bit (torch's AdamW is DeepSpeed's base optimizer here).
The Megatron goldens (torch_dist and legacy; GPT TP2 x PP2, MoE EP2, bf16 TP2 and the distributed
optimizer TP2 x DP2) the same way: the module of their TP1 PP1 names (torch_dist's as shardsafe
presents its keys), AdamW grouped as Megatron's own optimizer grouped them
(expected/local/*/optimizer_param_order.json, made global; the distributed optimizer's from
expected/full/), resumed from to-dcp's folder: Megatron's tensors, then Megatron's own next step
(expected/resume/, tests/peers/mcore_peer.py), bit for bit. The bf16 run's module is its fp32
masters (to-dcp --rename, MASTERS_AS_MODEL); the distributed optimizer's step, kept per param
group, comes in as each parameter's (to-dcp makes it so).
Needs torch 2.2 or later (get_state_dict): under Debian 12's torch 1.13 it skips (exit 77); the
Debian 13 leg runs it with torch 2.6.
"""
import os
import subprocess
import sys
import tempfile

import torch

if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 2):
    print(f"skipped: torch {torch.__version__} has no torch.distributed.checkpoint.state_dict")
    sys.exit(77)

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402

try:
    from safetensors.torch import load_file
except ImportError:  # Debian 13 has python3-safetensors; a plain reader otherwise
    load_file = None

CASES = [("zero2_fp32", "ckpt"), ("zero3_bf16", "ckpt"), ("zero3_bf16", "universal")]


def read(path):
    if load_file:
        return load_file(path)
    import json
    import struct
    b = open(path, "rb").read()
    (n,) = struct.unpack("<Q", b[:8])
    h = json.loads(b[8:8 + n])
    types = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}
    out = {}
    for k, v in h.items():
        if k == "__metadata__":
            continue
        s, e = v["data_offsets"]
        out[k] = torch.frombuffer(bytearray(b[8 + n + s:8 + n + e]), dtype=types[v["dtype"]]).reshape(v["shape"])
    return out


class Node(torch.nn.Module):
    pass


def owner(root, name):
    """The submodule of root that holds tensor `name` (made where missing), and the tensor's own name."""
    *path, leaf = name.split(".")
    m = root
    for p in path:
        if not hasattr(m, p):
            m.add_module(p, Node())
        m = getattr(m, p)
    return m, leaf


def make_model(expected):
    """The module the names describe: trainable parameters from fp32.safetensors (float32), every
    other tensor of module.safetensors a buffer in its dtype."""
    fp32 = read(os.path.join(expected, "fp32.safetensors"))
    module = read(os.path.join(expected, "module.safetensors"))
    root = Node()
    for name in list(fp32) + [n for n in module if n not in fp32]:
        m, leaf = owner(root, name)
        if name in fp32:
            m.register_parameter(leaf, torch.nn.Parameter(torch.zeros_like(fp32[name])))
        else:
            m.register_buffer(leaf, torch.zeros_like(module[name]))
    return root, fp32, module


def make_optimizer(model):
    """ds_peer.py's groups: 2-D trainable weights with weight decay, the rest without."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # the peer's order: its module's definition order, which param_shapes keeps
    decay = [p for n, p in named if p.dim() == 2]
    no_decay = [p for n, p in named if p.dim() != 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=1e-2)


def same(a, b, what, bad):
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
        bad.append(f"{what}: {tuple(a.shape)} {a.dtype} differs from {tuple(b.shape)} {b.dtype}")


def export(tool, root, case, form, tmp, bad, rules=()):
    """`shardsafe to-dcp` of the golden's checkpoint: the folder written, or None (in bad, why)."""
    out = os.path.join(tmp, f"{case}-{form}")
    p = subprocess.run([tool, "to-dcp", os.path.join(root, case, form), out, *rules], capture_output=True, text=True)
    if p.returncode != 0:
        bad.append(f"{case}/{form}: to-dcp exited {p.returncode}: {p.stderr.strip()}")
        return None
    return out


def check(tool, root, case, form, tmp, bad):
    expected, out = os.path.join(root, case, "expected"), export(tool, root, case, form, tmp, bad)
    if not out:
        return 0
    model, fp32, module = make_model(expected)
    opt = make_optimizer(model)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=out)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    moments = {k: read(os.path.join(expected, f"{k}.safetensors")) for k in ("exp_avg", "exp_avg_sq")}
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    for n, t in fp32.items():
        same(params[n].detach(), t, f"{case}/{form}: parameter {n}", bad)
        st = opt.state[params[n]]
        for k in ("exp_avg", "exp_avg_sq"):
            same(st[k], moments[k][n], f"{case}/{form}: {k} of {n}", bad)
        if float(st["step"]) != 2.0:
            bad.append(f"{case}/{form}: step of {n} is {st['step']!r}, not 2 (two AdamW steps)")
    for n, t in buffers.items():
        same(t, module[n], f"{case}/{form}: buffer {n}", bad)
    # the trainer's own resumed step (expected/resume/: its gradient, its state after the step)
    resume = {k: read(os.path.join(expected, "resume", f"{k}.safetensors"))
              for k in ("grad", "fp32", "exp_avg", "exp_avg_sq")}
    for n, q in model.named_parameters():
        q.grad = resume["grad"][n].clone()
    opt.step()
    for n in fp32:
        same(params[n].detach(), resume["fp32"][n], f"{case}/{form}: parameter {n} after the trainer's step", bad)
        for k in ("exp_avg", "exp_avg_sq"):
            same(opt.state[params[n]][k], resume[k][n], f"{case}/{form}: {k} of {n} after the trainer's step", bad)
    return len(fp32)


MEGATRON_CASES = [("mcore_gpt_tp2_pp2", "torch_dist"), ("mcore_gpt_tp2_pp2", "legacy"),
                  ("mcore_moe_ep2", "torch_dist"), ("mcore_moe_ep2", "legacy"),
                  ("mcore_gpt_bf16_tp2", "torch_dist"), ("mcore_gpt_bf16_tp2", "legacy"),
                  ("mcore_distopt_tp2_dp2", "torch_dist_fully_reshardable"), ("mcore_distopt_tp2_dp2", "legacy")]
# a bf16 run's fp32 masters as the module's parameters (docs/FORMAT.md §7): its bf16 weights left
# out and each optim.state.<name>.fp32 exported as model.<name>
MASTERS_AS_MODEL = ["--rename", r"^model\..*=", "--rename", r"^optim\.state\.(.*)\.fp32$=model.\1"]


def number_after(s, marker):
    at = s.find(marker)
    if at < 0:
        return None
    e = at + len(marker)
    while e < len(s) and s[e].isdigit():
        e += 1
    return s[at + len(marker):e] or None


def renumbered(s, marker, by):
    n = number_after(s, marker)
    if n is None:
        return s
    at = s.find(marker) + len(marker)
    return s[:at] + str(int(n) + by) + s[at + len(n):]


def torch_dist_name(module, key):
    """The name shardsafe presents a torch_dist tensor by (docs/FORMAT.md §7): its checkpoint key,
    a stacked layer (and expert) key per layer, numbered as the module name is."""
    stack, experts = "decoder.layers.", "mlp.experts.experts."
    if not key.startswith(stack) or key[len(stack)].isdigit():
        return key
    rest, layer = key[len(stack):], number_after(module, stack)
    if not rest.startswith(experts):
        return f"{stack}{layer}.{rest}"
    return f"{stack}{layer}.mlp.experts.local_experts.{number_after(module, '.local_experts.')}.{rest[len(experts):]}"


def megatron_groups(expected):
    """Megatron's own param groups of the whole model, by module name: each rank's
    expected/local/*/optimizer_param_order.json (its groups as its optimizer held them, local layer
    and expert numbers) made global and joined; for the distributed optimizer, whose ranks keep
    no such order, the groups of Megatron's TP1 PP1 optimizer that took the resumed step
    (expected/full/optimizer_param_order.json)."""
    import json
    ranks = sorted(os.listdir(os.path.join(expected, "local")))
    if not os.path.exists(os.path.join(expected, "local", ranks[0], "optimizer_param_order.json")):
        return json.load(open(os.path.join(expected, "full", "optimizer_param_order.json")))
    groups = []
    for rank in ranks:
        order = json.load(open(os.path.join(expected, "local", rank, "optimizer_param_order.json")))
        pp, ep = int(number_after(rank, "_pp")), int(number_after(rank, "_ep") or 0)
        layers = 1 + max([int(number_after(n, "decoder.layers.")) for g in order for n in g
                          if number_after(n, "decoder.layers.") is not None] or [-1])
        experts = 1 + max([int(number_after(n, ".local_experts.")) for g in order for n in g
                           if number_after(n, ".local_experts.") is not None] or [-1])
        while len(groups) < len(order):
            groups.append([])
        for g, names in enumerate(order):
            for n in names:
                n = renumbered(renumbered(n, "decoder.layers.", pp * layers), ".local_experts.", ep * experts)
                if n not in groups[g]:
                    groups[g].append(n)
    return groups


def check_megatron(tool, root, case, form, tmp, bad):
    """A Megatron golden: the module of its TP1 PP1 names (torch_dist: as shardsafe presents its keys),
    AdamW grouped as Megatron's own optimizer grouped them (lr 1e-2, weight decay 0.01 in every
    group, as the peer's optimizer held it), resumed from to-dcp's folder, then Megatron's own next
    step (expected/resume/) taken with its gradient. A bf16 run (expected/full/fp32.safetensors: the
    masters of Float16OptimizerWithFloat16Params) is exported with its masters as the model's
    parameters (MASTERS_AS_MODEL), the fp32 module Megatron's optimizer steps."""
    import json
    expected = os.path.join(root, case, "expected")
    masters = os.path.exists(os.path.join(expected, "full", "fp32.safetensors"))
    out = export(tool, root, case, form, tmp, bad, MASTERS_AS_MODEL if masters else ())
    if not out:
        return 0
    keys = json.load(open(os.path.join(expected, "full", "checkpoint_keys.json")))
    name = (lambda m: torch_dist_name(m, keys[m]["key"])) if form.startswith("torch_dist") else (lambda m: m)
    full = {k: read(os.path.join(expected, "full", f"{k}.safetensors")) for k in ("model", "exp_avg", "exp_avg_sq")}
    if masters:
        full["model"] = read(os.path.join(expected, "full", "fp32.safetensors"))
    resume = {k: read(os.path.join(expected, "resume", f"{k}.safetensors"))
              for k in ("grad", "fp32", "exp_avg", "exp_avg_sq")}
    root_module = Node()
    params = {}
    for m, t in full["model"].items():
        node, leaf = owner(root_module, name(m))
        node.register_parameter(leaf, torch.nn.Parameter(torch.zeros_like(t)))
        params[m] = getattr(node, leaf)
    opt = torch.optim.AdamW([{"params": [params[m] for m in g]} for g in megatron_groups(expected)], lr=1e-2,
                            weight_decay=0.01)
    msd, osd = get_state_dict(root_module, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=out)
    set_state_dict(root_module, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    for m, q in params.items():
        same(q.detach(), full["model"][m], f"{case}/{form}: parameter {m}", bad)
        for k in ("exp_avg", "exp_avg_sq"):
            same(opt.state[q][k], full[k][m], f"{case}/{form}: {k} of {m}", bad)
        if float(opt.state[q]["step"]) != 2.0:
            bad.append(f"{case}/{form}: step of {m} is {opt.state[q]['step']!r}, not 2")
        q.grad = resume["grad"][m].clone()
    opt.step()
    for m, q in params.items():
        same(q.detach(), resume["fp32"][m], f"{case}/{form}: parameter {m} after Megatron's step", bad)
        for k in ("exp_avg", "exp_avg_sq"):
            same(opt.state[q][k], resume[k][m], f"{case}/{form}: {k} of {m} after Megatron's step", bad)
    return len(params)


def main():
    tool = sys.argv[1]
    root = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                              "fixtures", "peers")
    bad = []
    with tempfile.TemporaryDirectory() as tmp:
        for case, form in CASES + MEGATRON_CASES:
            n = (check_megatron if case.startswith("mcore_") else check)(tool, root, case, form, tmp, bad)
            if not bad:
                print(f"ok {case}/{form}: torch {torch.__version__} resumed {n} parameters and their AdamW state "
                      f"from to-dcp's folder (get_state_dict, dcp.load, set_state_dict), equal to the trainer's, "
                      f"and the trainer's own next step, bit for bit")
    for b in bad[:20]:
        print("FAILED", b)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
