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
  3. one more AdamW step with a fixed gradient, against a second model + AdamW whose parameters and
     state were set from expected/ directly, given the same gradient: equal bit for bit.
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


def make_model(expected):
    """The module the names describe: trainable parameters from fp32.safetensors (float32), every
    other tensor of module.safetensors a buffer in its dtype."""
    fp32 = read(os.path.join(expected, "fp32.safetensors"))
    module = read(os.path.join(expected, "module.safetensors"))
    root = Node()
    for name in list(fp32) + [n for n in module if n not in fp32]:
        *path, leaf = name.split(".")
        m = root
        for p in path:
            if not hasattr(m, p):
                m.add_module(p, Node())
            m = getattr(m, p)
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


def fixed_grads(model):
    g = torch.Generator().manual_seed(54)
    for n, p in sorted(model.named_parameters()):
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)


def same(a, b, what, bad):
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
        bad.append(f"{what}: {tuple(a.shape)} {a.dtype} differs from {tuple(b.shape)} {b.dtype}")


def check(tool, root, case, form, tmp, bad):
    ck = os.path.join(root, case, form)
    expected = os.path.join(root, case, "expected")
    out = os.path.join(tmp, f"{case}-{form}")
    p = subprocess.run([tool, "to-dcp", ck, out], capture_output=True, text=True)
    if p.returncode != 0:
        bad.append(f"{case}/{form}: to-dcp exited {p.returncode}: {p.stderr.strip()}")
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
    # the reference: the trainer's tensors set directly, the same step
    ref, _, _ = make_model(expected)
    ref_opt = make_optimizer(ref)
    with torch.no_grad():
        for n, q in ref.named_parameters():
            q.copy_(fp32[n])
    for n, q in ref.named_parameters():
        ref_opt.state[q] = {"step": torch.tensor(2.0), "exp_avg": moments["exp_avg"][n].clone(),
                            "exp_avg_sq": moments["exp_avg_sq"][n].clone()}
    fixed_grads(model)
    fixed_grads(ref)
    opt.step()
    ref_opt.step()
    rp = dict(ref.named_parameters())
    for n in fp32:
        same(params[n].detach(), rp[n].detach(), f"{case}/{form}: parameter {n} after the resumed step", bad)
        for k in ("exp_avg", "exp_avg_sq"):
            same(opt.state[params[n]][k], ref_opt.state[rp[n]][k], f"{case}/{form}: {k} of {n} after the step", bad)
    return len(fp32)


def main():
    tool = sys.argv[1]
    root = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                              "fixtures", "peers")
    bad = []
    with tempfile.TemporaryDirectory() as tmp:
        for case, form in CASES:
            n = check(tool, root, case, form, tmp, bad)
            if not bad:
                print(f"ok {case}/{form}: torch {torch.__version__} resumed {n} parameters and their AdamW state "
                      f"from to-dcp's folder (get_state_dict, dcp.load, set_state_dict), equal to the trainer's, "
                      f"and one more step equals AdamW's from the trainer's own tensors, bit for bit")
    for b in bad[:20]:
        print("FAILED", b)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
