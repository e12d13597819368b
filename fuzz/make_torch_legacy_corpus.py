"""Writes fuzz/corpus/torch_legacy/: seeds for fuzz_torch_legacy, made by real torch (1.13, at
/usr/bin/python3 here) in torch.save's legacy format (_use_new_zipfile_serialization=False),
pickle protocols 2 (torch's default) and 4 (with FRAMEs): a state dict (several dtypes, a 0-d
and an empty tensor, tied weights, a slice at a storage offset, a transposed tensor) and a
training checkpoint (model and optimizer state dicts, epoch, loss, a scheduler's values).

    /usr/bin/python3 fuzz/make_torch_legacy_corpus.py [OUTDIR]
"""
import os
import sys

import torch

out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus",
                                                         "torch_legacy")
os.makedirs(out, exist_ok=True)
torch.manual_seed(0)


def state_dict():
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    base = torch.arange(10, dtype=torch.int64)
    return {
        "w": w,
        "tied": w,  # the same storage twice
        "wt": w.t(),  # transposed: its dimensions stored in the other order
        "half": torch.tensor([1.5, -2.0], dtype=torch.float16),
        "bf": torch.tensor([0.25], dtype=torch.bfloat16),
        "slice": base[3:7],  # a storage offset into a larger storage
        "flag": torch.tensor([True, False, True]),
        "i8": torch.tensor([-1, 2], dtype=torch.int8),
        "scalar": torch.tensor(3.0, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
    }


def training_checkpoint():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    return {"epoch": 3, "loss": 0.5, "model": model.state_dict(), "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(), "note": "legacy", "steps": [1, 2, 3]}


for name, value in (("state_dict", state_dict()), ("train", training_checkpoint())):
    for proto in (2, 4):
        path = os.path.join(out, "torch%s_%s_p%d" % (torch.__version__.split("+")[0].replace(".", "")[:3], name, proto))
        torch.save(value, path, _use_new_zipfile_serialization=False, pickle_protocol=proto)
        back = torch.load(path)  # the seed is a file torch reads
        assert set(back) == set(value)
        print(path, os.path.getsize(path))
