#!/usr/bin/env python3
"""The deepspeed layout (include/shardsafe/checkpoint/layouts/deepspeed.hpp) against the trainer's
own tensors: for each DeepSpeed golden of tests/fixtures/peers/, `shardsafe unshard` of the
checkpoint (given as the folder with `latest`, and as its tag folder) must hold, bit for bit,
every tensor of the golden's expected/ (DeepSpeed's live engine wrote those, not this code), and
nothing else; `inspect`, `verify` and `digest` must exit 0.

    python3 tests/peers/deepspeed_layout_check.py build/tools/shardsafe [tests/fixtures/peers]

Plain Python (no torch): safetensors files are parsed with struct and json here.

What is compared (names as docs/FORMAT.md's DeepSpeed section presents them):
  ZeRO-1/2: <name> == expected/module.safetensors[name]; optimizer.state.<name>.{fp32,exp_avg,
  exp_avg_sq} == expected/<kind>.safetensors[name]; optimizer.state.<name>.step == step.json's
  adam_step (a 0-d float32).
  ZeRO-3 and universal checkpoints: a trainable parameter is its fp32 master: <name> == expected/fp32.safetensors[name],
  and rounded to bfloat16 (nearest, ties to even) it is expected/module.safetensors[name] (the
  trainer's gathered weight); buffers and frozen parameters == expected/module.safetensors.
  TP 2 (zero2_bf16_tp2): the parameters and their state joined, as the checkpoint's
  universal_checkpoint_info says, against expected/joined/; buffers and frozen parameters under
  tp{T}/ against expected/tp{T}/. The same checkpoint with that info's key renamed: every name
  under tp{T}/, against expected/tp{T}/.
  Universal checkpoints (universal/, ds_to_universal's output, given as the folder with
  latest_universal and as its tag folder): every parameter and its state whole (TP joined by
  ds_to_universal), buffers and frozen parameters as in the checkpoint they came from.
"""
import json
import os
import shutil
import struct
import sys
import tempfile

from golden_check import compare, golden_cases, read_safetensors, run, unshard


def bf16_round(f32_bytes):
    """float32 values (little-endian bytes) rounded to bfloat16, nearest with ties to even"""
    out = bytearray()
    for (u,) in struct.iter_unpack("<I", f32_bytes):
        if (u & 0x7F800000) == 0x7F800000 and (u & 0x7FFFFF):  # NaN stays NaN
            r = (u >> 16) | 0x40
        else:
            r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        out += struct.pack("<H", r & 0xFFFF)
    return bytes(out)


def check_case(tool, case_dir, path, tmp, joined, universal=False):
    meta = json.load(open(os.path.join(case_dir, "expected", "meta.json")))
    master = meta["stage"] == 3 or universal  # a trainable parameter is presented as its fp32 master
    for cmd in ("inspect", "verify", "digest"):
        run(tool, cmd, path)
    got = unshard(tool, path, tmp)
    want = {}  # presented name -> (dtype, shape, bytes)
    rounded = {}  # ZeRO-3 parameter name -> expected bf16 bytes of its rounded master
    tps = [""] if meta["tp"] == 1 else [f"tp{t}/" for t in range(meta["tp"])]
    if joined:  # parameters and their state joined (expected/joined/), the rest per TP rank
        exp = os.path.join(case_dir, "expected", "joined")
        kinds = {k: read_safetensors(os.path.join(exp, f"{k}.safetensors")) for k in ("module", "fp32", "exp_avg",
                                                                                      "exp_avg_sq")}
        step = json.load(open(os.path.join(case_dir, "expected", "tp0", "step.json")))["adam_step"]
        for name in kinds["fp32"]:
            want[name] = kinds["fp32"][name] if master else kinds["module"][name]
            if master:
                rounded[name] = kinds["module"][name][2]
            for k in ("fp32", "exp_avg", "exp_avg_sq"):
                want[f"optimizer.state.{name}.{k}"] = kinds[k][name]
            want[f"optimizer.state.{name}.step"] = ("F32", (), struct.pack("<f", step))
        for tp in tps:
            module = read_safetensors(os.path.join(case_dir, "expected", tp.rstrip("/"), "module.safetensors"))
            for name, t in module.items():
                if name not in kinds["fp32"]:
                    want[tp + name] = t
        tps = []
    for tp in tps:
        exp = os.path.join(case_dir, "expected", tp.rstrip("/"))
        kinds = {k: read_safetensors(os.path.join(exp, f"{k}.safetensors")) for k in ("module", "fp32", "exp_avg",
                                                                                      "exp_avg_sq")}
        step = json.load(open(os.path.join(exp, "step.json")))["adam_step"]
        for name, t in kinds["module"].items():
            if master and name in kinds["fp32"]:
                want[tp + name] = kinds["fp32"][name]
                rounded[tp + name] = t[2]
            else:
                want[tp + name] = t
        for k in ("fp32", "exp_avg", "exp_avg_sq"):
            for name, t in kinds[k].items():
                want[f"{tp}optimizer.state.{name}.{k}"] = t
        for name in kinds["fp32"]:
            want[f"{tp}optimizer.state.{name}.step"] = ("F32", (), struct.pack("<f", step))
    compare(path, got, want, "the trainer's")
    for name, b in rounded.items():
        if bf16_round(got[name][2]) != b:
            raise SystemExit(f"FAILED {path}: '{name}': the fp32 master rounded to bfloat16 is not the "
                             "trainer's gathered weight")
    return len(want)


def main():
    tool, root, cases = golden_cases(sys.argv, "zero", "DeepSpeed")
    with tempfile.TemporaryDirectory() as tmp:
        for c in cases:
            case_dir = os.path.join(root, c)
            ckpt = os.path.join(case_dir, "ckpt")
            tag = open(os.path.join(ckpt, "latest")).read().strip()
            tp = json.load(open(os.path.join(case_dir, "expected", "meta.json")))["tp"] > 1
            n = [check_case(tool, case_dir, p, tmp, tp) for p in (ckpt, os.path.join(ckpt, tag))]
            print(f"ok {c}: {n[0]} tensors equal the trainer's bit for bit (folder with latest, and {tag}/)" +
                  (", TP ranks joined by universal_checkpoint_info" if tp else ""))
            uni = os.path.join(case_dir, "universal")
            if os.path.isdir(uni):
                utag = open(os.path.join(uni, "latest_universal")).read().strip()
                n = [check_case(tool, case_dir, p, tmp, tp, True) for p in (uni, os.path.join(uni, utag))]
                print(f"ok {c} universal: {n[0]} tensors equal the trainer's bit for bit (folder with "
                      f"latest_universal, and {utag}/)")
            # the same without the join rule (its key renamed), and with a pattern beyond the plain
            # regular expressions the layout reads: every TP rank on its own, never a guessed join
            for what, old, new in (("without universal_checkpoint_info", b"universal_checkpoint_info",
                                    b"universal_checkpoint_infx"),
                                   ("with a pattern (norm)\\.* it does not read", b"^norm\\..*", b"(norm)\\.*")):
                if not tp:
                    break
                copy = os.path.join(tmp, c + str(len(what)))
                shutil.copytree(ckpt, copy)
                rename_key(os.path.join(copy, tag, "mp_rank_00_model_states.pt"), old, new)
                n = check_case(tool, case_dir, copy, tmp, False)
                print(f"ok {c} {what}: {n} tensors per TP rank (tp{{T}}/), bit for bit")


def rename_key(path, old, new):
    """The torch.save archive at path with `old` in its data.pkl replaced by `new` (as long)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from torch_archive_edit import patch_data_pkl
    patch_data_pkl(path, [(None, old, new)])


if __name__ == "__main__":
    main()
