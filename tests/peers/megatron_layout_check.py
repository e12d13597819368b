#!/usr/bin/env python3
"""The megatron_dist and megatron_legacy layouts (include/shardsafe/checkpoint/layouts/) against the
trainer's own tensors: for each Megatron-Core golden of tests/fixtures/peers/ (mcore_*),
`shardsafe unshard` of its torch_dist checkpoint (given as the folder with
latest_checkpointed_iteration.txt, and as its iter_NNNNNNN/ folder) must hold, bit for bit, every
tensor of expected/full/ (Megatron-Core 0.16.1's own dist_checkpointing.load of that checkpoint
into a TP1 PP1 EP1 model wrote those, not this code), under the name the layout presents it by,
and its optimizer state; `inspect`, `verify` and `digest` must exit 0.

    python3 tests/peers/megatron_layout_check.py build/tools/shardsafe [tests/fixtures/peers]

Plain Python (no torch). Names (docs/FORMAT.md §7): expected/full/checkpoint_keys.json maps each
module name to its checkpoint key; a stacked key decoder.layers.<rest> is presented per layer as
decoder.layers.<L>.<rest>, an expert key decoder.layers.mlp.experts.experts.<rest> as
decoder.layers.<L>.mlp.experts.local_experts.<E>.<rest> (L and E the module name's, the global
ones at TP1 PP1 EP1); exp_avg and exp_avg_sq as optimizer.state.<name>.exp_avg[_sq]; the step
(common.pt's common_step, two AdamW steps) as optimizer.state.<name>.step; the distributed
optimizer's fp32 masters (fully_reshardable) as optimizer.state.<name>.fp32.

The distributed optimizer's dp_reshardable form (mcore_distopt_tp2_dp2/torch_dist) holds its
state as buffers whose parameters' places are not in the checkpoint: verify and unshard must
refuse naming the buffer and the flag to re-save with, and `to-hf` dropping optimizer.* must give the
model's tensors.

Each checkpoint's `to-dcp` output must read back (verify, unshard) with the same tensors under
get_state_dict's keys (model.<name>, optim.state.<name>.<field>); the distributed optimizer's step,
kept per param group, becomes each parameter's optim.state.<name>.step (F32 2.0), as torch's AdamW
keeps it.

Each golden's legacy/ save (the same run, --ckpt-format torch: mp_rank_TT[_PPP][_EEE]/) must hold
expected/full's tensors under the module names themselves (global layer and expert numbers), with
Adam's state as optimizer.state.<name>.{exp_avg,exp_avg_sq,step}, or, from the distributed
optimizer's distrib_optim.pt, .{fp32,exp_avg,exp_avg_sq}.
"""
import json
import os
import re
import struct
import subprocess
import sys
import tempfile

from golden_check import compare, golden_cases, read_safetensors, run, unshard


def presented(module, info):
    """The name the layout presents module tensor `module` by (its checkpoint key made per layer)."""
    key = info["key"]
    stack = "decoder.layers."
    if not key.startswith(stack) or key[len(stack)].isdigit():
        return key
    layer = re.match(r"decoder\.layers\.(\d+)\.", module).group(1)
    rest = key[len(stack):]
    experts = "mlp.experts.experts."
    if rest.startswith(experts):
        expert = re.search(r"\.local_experts\.(\d+)\.", module).group(1)
        return f"{stack}{layer}.mlp.experts.local_experts.{expert}.{rest[len(experts):]}"
    return f"{stack}{layer}.{rest}"


def optimizer_kinds(full):
    """The optimizer's tensors of expected/full: Adam's moments and, from a bf16 run
    (Float16OptimizerWithFloat16Params), the fp32 masters Megatron loaded (fp32.safetensors)."""
    return [("exp_avg", ".exp_avg"), ("exp_avg_sq", ".exp_avg_sq")] + (
        [("fp32", ".fp32")] if os.path.exists(os.path.join(full, "fp32.safetensors")) else [])


def want_of(case_dir, with_optimizer, masters=False):
    """masters: the optimizer keeps fp32 masters (the distributed optimizer's fully_reshardable form:
    optimizer.state.param.<key>), which in these fp32 runs equal the model's tensors; its step is
    per param group in common.pt, not common_step, so no .step tensor is presented. A bf16 run's
    masters (optimizer.state.fp32_param.<key>) are expected/full/fp32.safetensors."""
    full = os.path.join(case_dir, "expected", "full")
    keys = json.load(open(os.path.join(full, "checkpoint_keys.json")))
    want = {}
    kinds = [("model", "")] + (optimizer_kinds(full) if with_optimizer else [])
    for kind, suffix in kinds:
        for module, t in read_safetensors(os.path.join(full, f"{kind}.safetensors")).items():
            name = presented(module, keys[module])
            want[name if kind == "model" else f"optimizer.state.{name}{suffix}"] = t
            if kind == "exp_avg" and not masters:
                want[f"optimizer.state.{name}.step"] = ("F32", (), struct.pack("<f", 2.0))
            if kind == "model" and masters and with_optimizer:
                want[f"optimizer.state.{name}.fp32"] = t
    return want


def legacy_want_of(case_dir, masters):
    """The legacy layout presents the model's module names with global layer and expert numbers:
    expected/full's names themselves; the distributed optimizer's distrib_optim.pt adds the fp32
    masters (equal to the model in these fp32 runs) and has no per-parameter step; a bf16 run's
    fp32_from_fp16_params are expected/full/fp32.safetensors."""
    full = os.path.join(case_dir, "expected", "full")
    want = dict(read_safetensors(os.path.join(full, "model.safetensors")))
    for kind, suffix in optimizer_kinds(full):
        for module, t in read_safetensors(os.path.join(full, f"{kind}.safetensors")).items():
            want[f"optimizer.state.{module}{suffix}"] = t
            if kind == "exp_avg":
                if masters:
                    want[f"optimizer.state.{module}.fp32"] = want[module]
                else:
                    want[f"optimizer.state.{module}.step"] = ("F32", (), struct.pack("<f", 2.0))
    return want


def check(tool, case_dir, path, tmp, masters, legacy=False):
    for cmd in ("inspect", "verify", "digest"):
        run(tool, cmd, path)
    got = unshard(tool, path, tmp)
    want = legacy_want_of(case_dir, masters) if legacy else want_of(case_dir, True, masters)
    compare(path, got, want, "Megatron's")
    # to-dcp keys it as get_state_dict does (model.*, optim.state.*), leaving the per-rank RNG
    # states out: shardsafe reads the folder it wrote, every tensor under its new key
    dcp = os.path.join(tmp, "dcp")
    subprocess.run(["rm", "-rf", dcp])
    run(tool, "to-dcp", path, dcp)
    run(tool, "verify", dcp)
    back = unshard(tool, dcp, tmp)
    renamed = {("optim." + n[len("optimizer."):] if n.startswith("optimizer.state.") else "model." + n): t
               for n, t in want.items()}
    if masters:  # the distributed optimizer's step, per param group (2), made each parameter's
        for n in want:
            if n.endswith(".exp_avg"):
                renamed["optim." + n[len("optimizer."):-len(".exp_avg")] + ".step"] = ("F32", (), struct.pack("<f", 2.0))
    compare(dcp, back, renamed, "Megatron's (through to-dcp)")
    return len(want)


def main():
    tool, root, cases = golden_cases(sys.argv, "mcore_", "Megatron-Core")
    with tempfile.TemporaryDirectory() as tmp:
        for c in cases:
            case_dir = os.path.join(root, c)
            for form in ("torch_dist", "torch_dist_fully_reshardable"):
                top = os.path.join(case_dir, form)
                if not os.path.isdir(top):
                    continue
                it = int(open(os.path.join(top, "latest_checkpointed_iteration.txt")).read().strip())
                paths = (top, os.path.join(top, f"iter_{it:07d}"))
                if c == "mcore_distopt_tp2_dp2" and form == "torch_dist":  # dp_reshardable
                    for p in paths:
                        for cmd in ("verify", "unshard"):
                            args = [cmd, p] + ([os.path.join(tmp, "x.safetensors")] if cmd == "unshard" else [])
                            err = run(tool, *args, rc=1)
                            for word in ("optimizer.distributed.", "dp_reshardable",
                                         "--dist-ckpt-optim-fully-reshardable"):
                                if word not in err:
                                    raise SystemExit(f"FAILED {p}: {cmd}'s refusal does not say '{word}': {err}")
                        hf = os.path.join(tmp, "hf")
                        subprocess.run(["rm", "-rf", hf])
                        run(tool, "to-hf", p, hf, "--rename", r"^optimizer\..*=")
                        got = read_safetensors(os.path.join(hf, "model.safetensors"))
                        want = want_of(case_dir, False)
                        if got != want:
                            raise SystemExit(f"FAILED {p}: to-hf without optimizer.* differs from Megatron's model: "
                                             f"{sorted(set(got) ^ set(want))[:8]}")
                    print(f"ok {c} {form} (dp_reshardable): optimizer buffers refused naming the flag; "
                          f"{len(want)} model tensors equal Megatron's through to-hf --rename '^optimizer\\..*='")
                    continue
                n = [check(tool, case_dir, p, tmp, form.endswith("fully_reshardable")) for p in paths]
                print(f"ok {c} {form}: {n[0]} tensors equal Megatron's bit for bit (the folder with "
                      f"latest_checkpointed_iteration.txt, and iter_{it:07d}/)")
            # the legacy (torch format) save of the same run: TP pieces, stages and EP ranks joined
            top = os.path.join(case_dir, "legacy")
            it = int(open(os.path.join(top, "latest_checkpointed_iteration.txt")).read().strip())
            paths = (top, os.path.join(top, f"iter_{it:07d}"))
            n = [check(tool, case_dir, p, tmp, c == "mcore_distopt_tp2_dp2", legacy=True) for p in paths]
            print(f"ok {c} legacy: {n[0]} tensors equal Megatron's bit for bit (the folder with "
                  f"latest_checkpointed_iteration.txt, and iter_{it:07d}/)")


if __name__ == "__main__":
    main()
