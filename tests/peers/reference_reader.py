#!/usr/bin/env python3
"""A reference reader of the peer goldens, in plain Python + torch, written from
docs/layouts-notes/{deepspeed,megatron}.md only: no DeepSpeed, no Megatron on the path. It joins
the checkpoints' pieces by the documented rules and compares them bit for bit with each golden's
expected/ tensors (which the trainers themselves produced). It is what shardsafe's C++ readers
must reproduce, and it checks the notes.

    python3 tests/peers/reference_reader.py [tests/fixtures/peers]

Runs anywhere torch and safetensors are (the Debian 13 root: scripts/env-debian13.sh run ...).
Unknown classes in the pickles (DeepSpeed's fragment_address, LossScaler, ZeroStageEnum,
Megatron's enums) are read as opaque stand-ins: their constructor arguments and state are kept.
"""
import glob
import json
import os
import pickle
import re
import sys
import types

import torch
import safetensors.torch as st


class Opaque:
    """Stands for a class of a trainer: keeps what the pickle gives it."""

    def __new__(cls, *args, **kwargs):  # NEWOBJ
        self = object.__new__(cls)
        self.args, self.kwargs, self.state = args, kwargs, None
        return self

    def __init__(self, *args, **kwargs):  # REDUCE calls the class: same arguments
        pass

    def __setstate__(self, state):
        self.state = state

    def __repr__(self):
        return f"{type(self).__qualname__}{self.args}"


_stubs = {}


class StubUnpickler(pickle.Unpickler):

    def find_class(self, module, name):
        if module.split(".")[0] in ("deepspeed", "megatron"):
            key = f"{module}.{name}"
            if key not in _stubs:
                _stubs[key] = type(name, (Opaque,), {"__qualname__": key})
            return _stubs[key]
        return super().find_class(module, name)


stub_pickle = types.ModuleType("stub_pickle")
stub_pickle.Unpickler = StubUnpickler
stub_pickle.load = lambda f, **kw: StubUnpickler(f, **kw).load()
stub_pickle.__name__ = "pickle"


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False, pickle_module=stub_pickle)


def same(a, b, what):
    if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
        raise SystemExit(f"MISMATCH {what}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")


# ------------------------------------------------------------------------------------------------
# DeepSpeed


def ds_files(tagdir, mp):
    optim = sorted(glob.glob(os.path.join(tagdir, f"*zero_pp_rank_*_mp_rank_{mp:02d}_optim_states.pt")),
                   key=lambda p: int(re.search(r"zero_pp_rank_(\d+)_", p).group(1)))
    return [load(p) for p in optim]


def ds_zero12(tagdir, mp):
    """{kind: {name: tensor}} for one TP rank, by param_slice_mappings (deepspeed.md §3)"""
    model = load(os.path.join(tagdir, f"mp_rank_{mp:02d}_model_states.pt"))
    ranks = ds_files(tagdir, mp)
    out = {"fp32": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for g, shapes in enumerate(model["param_shapes"]):
        pieces = {k: {n: [] for n in shapes} for k in out}
        for r in ranks:
            osd = r["optimizer_state_dict"]
            flats = {"fp32": osd["single_partition_of_fp32_groups"][g],
                     "exp_avg": osd["base_optimizer_state"]["state"][g]["exp_avg"],
                     "exp_avg_sq": osd["base_optimizer_state"]["state"][g]["exp_avg_sq"]}
            for name, addr in osd["param_slice_mappings"][g].items():
                numel, start = addr.state["numel"], addr.state["start"]  # fragment_address: BUILD {numel, start}
                for k in out:
                    pieces[k][name].append(flats[k][start:start + numel])
        for k in out:
            for name, shape in shapes.items():
                out[k][name] = torch.cat(pieces[k][name]).view(shape)
    out["module"] = {n: t for n, t in model["module"].items()}
    return out, model


def ds_zero3(tagdir):
    """per-parameter partitions, ceil(numel/dp) each, in param_shapes order (deepspeed.md §4)"""
    models = sorted(glob.glob(os.path.join(tagdir, "zero_pp_rank_*_mp_rank_00_model_states.pt")))
    model = load(models[0])
    ranks = ds_files(tagdir, 0)
    dp = len(ranks)
    out = {"fp32": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for g, shapes in enumerate(model["param_shapes"]):
        flats = [{"fp32": r["optimizer_state_dict"]["fp32_flat_groups"][g],
                  "exp_avg": r["optimizer_state_dict"]["optimizer_state_dict"]["state"][g]["exp_avg"],
                  "exp_avg_sq": r["optimizer_state_dict"]["optimizer_state_dict"]["state"][g]["exp_avg_sq"]}
                 for r in ranks]
        off = 0
        for name, shape in shapes.items():
            numel = shape.numel()
            part = -(-numel // dp)
            for k in out:
                out[k][name] = torch.cat([f[k][off:off + part] for f in flats])[:numel].view(shape)
            off += part
        assert off == flats[0]["fp32"].numel(), (off, flats[0]["fp32"].numel())
    return out, model


def ds_universal(unidir, param_shapes):
    out = {"fp32": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for k in out:
        for name, shape in param_shapes.items():
            o = load(os.path.join(unidir, "zero", name, f"{k}.pt"))
            out[k][name] = o["param"] if isinstance(o, dict) else o.view(shape)
    return out


def check_ds(case_dir):
    name = os.path.basename(case_dir)
    meta = json.load(open(os.path.join(case_dir, "expected", "meta.json")))
    ck = os.path.join(case_dir, "ckpt")
    tag = open(os.path.join(ck, "latest")).read().strip()
    tagdir = os.path.join(ck, tag)
    said = []
    if meta["stage"] == 3:
        got, model = ds_zero3(tagdir)
        exp = {k: st.load_file(os.path.join(case_dir, "expected", f"{k}.safetensors"))
               for k in ("fp32", "exp_avg", "exp_avg_sq", "module")}
        for k in ("fp32", "exp_avg", "exp_avg_sq"):
            for n, t in exp[k].items():
                same(got[k][n], t, f"{name} {k} {n}")
        # the low-precision weights are not in ZeRO-3 files: they are the fp32 masters rounded
        for n, t in exp["module"].items():
            if n in got["fp32"]:
                same(got["fp32"][n].to(t.dtype), t, f"{name} module {n} (fp32 master rounded)")
        said.append("ZeRO-3 flat groups by per-parameter ceil(numel/dp) pieces; bf16 module == fp32 master rounded")
        shapes = {n: s for d in model["param_shapes"] for n, s in d.items()}
    else:
        tps = meta["tp"]
        per_tp = []
        for mp in range(tps):
            got, model = ds_zero12(tagdir, mp)
            sub = os.path.join(case_dir, "expected", f"tp{mp}") if tps > 1 else os.path.join(case_dir, "expected")
            for k in ("fp32", "exp_avg", "exp_avg_sq", "module"):
                exp = st.load_file(os.path.join(sub, f"{k}.safetensors"))
                for n, t in exp.items():
                    same(got[k][n], t, f"{name} tp{mp} {k} {n}")
            per_tp.append((got, model))
        said.append("ZeRO-1/2 flat partitions by param_slice_mappings; module tensors as stored")
        shapes = {n: s for d in per_tp[0][1]["param_shapes"] for n, s in d.items()}
        if tps > 1:
            info = per_tp[0][1]["universal_checkpoint_info"]
            joined = {}
            for k in ("fp32", "exp_avg", "exp_avg_sq"):
                joined[k] = {}
                for n in per_tp[0][0][k]:
                    parts = [g[k][n] for g, _ in per_tp]
                    if any(re.match(p, n) for p in info.get("tp_replicated_parameter_patterns", [])):
                        for p in parts[1:]:
                            same(p, parts[0], f"{name} replicated {n}")
                        joined[k][n] = parts[0]
                    else:
                        row = any(re.match(p, n) for p in info.get("parameter_with_row_parallelism_patterns", []))
                        joined[k][n] = torch.cat(parts, 1 if row else 0)
                exp = st.load_file(os.path.join(case_dir, "expected", "joined", f"{k}.safetensors"))
                for n, t in exp.items():
                    same(joined[k][n], t, f"{name} joined {k} {n}")
            said.append("TP pieces joined by universal_checkpoint_info patterns")
            shapes = {n: t.shape for n, t in joined["fp32"].items()}
    uni = os.path.join(case_dir, "universal")
    if os.path.isdir(uni):
        u = ds_universal(os.path.join(uni, open(os.path.join(uni, "latest_universal")).read().strip()), shapes)
        base = os.path.join(case_dir, "expected", "joined") if meta["tp"] > 1 else os.path.join(case_dir, "expected")
        for k in u:
            for n, t in st.load_file(os.path.join(base, f"{k}.safetensors")).items():
                same(u[k][n], t, f"{name} universal {k} {n}")
        said.append("universal zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt")
    return said


# ------------------------------------------------------------------------------------------------
# Megatron torch_dist


def dcp_tensors(ckdir):
    """every tensor of a DCP checkpoint, whole, by key (no process group). Megatron's .metadata has
    planner_data None, so the tensors are made from the metadata's global shapes and loaded into."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    reader = dcp.FileSystemReader(ckdir)
    md = reader.read_metadata()
    sd = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
          if isinstance(v, TensorStorageMetadata)}
    dcp.load(sd, storage_reader=reader)
    return sd


def check_mcore(case_dir):
    """torch_dist keys -> module names: checkpoint_keys.json (Megatron's own ShardedTensor keys);
    the layer (and expert) index is the prepended axis (megatron.md §2.2)"""
    name = os.path.basename(case_dir)
    td = os.path.join(case_dir, "torch_dist")
    it = int(open(os.path.join(td, "latest_checkpointed_iteration.txt")).read())
    ckdir = os.path.join(td, f"iter_{it:07d}")
    assert json.load(open(os.path.join(ckdir, "metadata.json")))["sharded_backend"] == "torch_dist"
    tensors = dcp_tensors(ckdir)
    # with the distributed optimizer, torch_dist (dp_reshardable) holds the optimizer as opaque
    # buckets; the per-parameter form is in the fully_reshardable save
    fr = os.path.join(case_dir, "torch_dist_fully_reshardable", f"iter_{it:07d}")
    opt_tensors = dcp_tensors(fr) if os.path.isdir(fr) else tensors
    keys = json.load(open(os.path.join(case_dir, "expected", "full", "checkpoint_keys.json")))
    n_checked = 0
    for kind, prefix in (("model", ""), ("exp_avg", "optimizer.state.exp_avg."),
                         ("exp_avg_sq", "optimizer.state.exp_avg_sq.")):
        exp = st.load_file(os.path.join(case_dir, "expected", "full", f"{kind}.safetensors"))
        for n, t in exp.items():
            info = keys[n]
            whole = (opt_tensors if prefix else tensors)[prefix + info["key"]]
            # leading indices: the prepended axes (layer; layer and expert), from the module name
            idx = [int(x) for x in re.findall(r"\.layers\.(\d+)\.", n)]
            idx += [int(x) for x in re.findall(r"\.local_experts\.(\d+)\.", n)]
            if info["type"] == "ShardedTensor":
                assert idx == info["global_offset"][:info["prepend_axis_num"]], (n, idx, info)
            for i in idx:
                whole = whole[i]
            same(whole, t, f"{name} torch_dist {prefix}{info['key']}{idx}")
            n_checked += 1
    said = [f"torch_dist: {n_checked} tensors, stacked keys indexed by (layer[, expert])"]
    said += check_mcore_legacy(case_dir)
    return said


def legacy_param_order(model_sd, param_groups):
    """Megatron's optimizer numbering (megatron.md §3): parameters in state-dict order, grouped by
    (no weight decay for biases and 1-D tensors: wd_mult 0) x (expert or not), the groups in the
    file's order; returns [[name, ...] per group]"""
    names = [n for n, v in model_sd.items() if isinstance(v, torch.Tensor)]

    def kind(n):
        no_wd = n.endswith(".bias") or model_sd[n].dim() == 1
        return (0.0 if no_wd else 1.0, ".local_experts." in n)

    return [[n for n in names if kind(n) == (g["wd_mult"], g["is_expert_parallel"])] for g in param_groups]


def distrib_optim_by_param(dopt, model, kind, align=64):
    """legacy distrib_optim.pt: {'buckets_coalesced': True, gbuf_idx: {(param dtype, grad dtype):
    {'param', 'exp_avg', 'exp_avg_sq': 1-D, 'numel_unpadded'}}}, the DP-gathered buffer of one TP
    rank. Megatron's grad buffer lays the parameters out in REVERSE model order, each start
    aligned to `align` elements (megatron.md §2.4). One buffer, one bucket assumed."""
    assert dopt["buckets_coalesced"] is True
    (buf,) = [v for k, v in dopt.items() if k != "buckets_coalesced"]
    (state,) = buf.values()
    flat = state[kind]
    out, off = {}, 0
    for n in reversed(list(model)):
        off = -(-off // align) * align
        numel = model[n].numel()
        out[n] = flat[off:off + numel].view(model[n].shape)
        off += numel
    assert off <= state["numel_unpadded"], (off, state["numel_unpadded"])
    return out


def check_mcore_legacy(case_dir):
    """legacy mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt joined by megatron.md §3.1"""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from mcore_peer import CASES, join, legacy_dir  # the rules only (no Megatron import)
    name = os.path.basename(case_dir)
    case = CASES[name]
    lg = os.path.join(case_dir, "legacy")
    it = int(open(os.path.join(lg, "latest_checkpointed_iteration.txt")).read())
    ranks = [(t, p, e) for t in range(case["tp"]) for p in range(case["pp"]) for e in range(case["ep"])]
    pieces = {k: {} for k in ("model", "exp_avg", "exp_avg_sq")}
    for r in ranks:
        sd = load(os.path.join(lg, f"iter_{it:07d}", legacy_dir(*r, case), "model_optim_rng.pt"))
        model = {n: v for n, v in sd["model"].items() if isinstance(v, torch.Tensor)}
        pieces["model"][r] = model
        if case.get("distopt"):
            dopt = load(os.path.join(lg, f"iter_{it:07d}", legacy_dir(*r, case), "distrib_optim.pt"))
            for k in ("exp_avg", "exp_avg_sq"):
                pieces[k][r] = distrib_optim_by_param(dopt, model, k)
            continue
        osd = sd["optimizer"]
        order = legacy_param_order(model, osd["param_groups"])
        for g, names in zip(osd["param_groups"], order):
            assert len(g["params"]) == len(names), (r, len(g["params"]), len(names))
        for k in ("exp_avg", "exp_avg_sq"):
            pieces[k][r] = {n: osd["state"][i][k] for g, names in zip(osd["param_groups"], order)
                            for i, n in zip(g["params"], names)}
    for k in pieces:
        whole = join(pieces[k], case)
        exp = st.load_file(os.path.join(case_dir, "expected", "full", f"{k}.safetensors"))
        assert set(whole) == set(exp), set(whole) ^ set(exp)
        for n, t in exp.items():
            same(whole[n], t, f"{name} legacy {k} {n}")
    return ["legacy: model and Adam state joined (TP rules, stage layer offsets, expert numbers), optimizer"
            + (" state from distrib_optim.pt buckets (reverse order, 64-element aligned starts)" if case.get("distopt")
               else " numbering by Megatron's grouping rule")]


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "fixtures", "peers")
    failed = 0
    for case_dir in sorted(glob.glob(os.path.join(root, "*"))):
        if not os.path.isdir(case_dir):
            continue
        name = os.path.basename(case_dir)
        try:
            said = check_mcore(case_dir) if name.startswith("mcore") else check_ds(case_dir)
            print(f"ok {name}: " + "; ".join(said))
        except (SystemExit, AssertionError, KeyError) as e:
            failed += 1
            print(f"FAILED {name}: {e!r}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
