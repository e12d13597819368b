"""Hostile cases of DeepSpeed ZeRO checkpoints (issue 54, checkpoint/layouts/deepspeed.hpp): the
golden tests/fixtures/peers/zero2_fp32 (DeepSpeed 0.19.5's own files) copied and broken one way
each; loaded by hostile.py, with its helpers (run, case, write, ...) in scope."""
import glob
import os
import shutil
import sys

DS_GOLDEN = os.path.join(SOURCE, "tests", "fixtures", "peers", "zero2_fp32", "ckpt")
DS_RANK1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


def ds_copy(t, name):
    """A copy of the ZeRO-2 golden (the folder with `latest`) under t/name; its tag folder."""
    d = os.path.join(t, name)
    shutil.copytree(DS_GOLDEN, d)
    return d, os.path.join(d, open(os.path.join(d, "latest")).read().strip())


def ds_patch_pickle(path, edits):
    """patch_data_pkl (tests/torch_archive_edit.py): each (after, old, new) replaces the first `old`
    past the first `after` by `new` of the same length."""
    sys.path.insert(0, os.path.join(HERE, ".."))
    from torch_archive_edit import patch_data_pkl
    patch_data_pkl(path, edits)


def ds_commands(d):
    return (["inspect", d], ["verify", d], ["digest", d])


@case
def deepspeed_missing_partition(t):
    """A DeepSpeed folder whose DP rank 1 optimizer partition is gone: refused by every command,
    naming the file, the rank and the world size (no tensor is presented from half the state)."""
    d, tag = ds_copy(t, "missing")
    os.remove(os.path.join(tag, DS_RANK1))
    for cmd in ds_commands(d):
        run("deepspeed_missing_partition", cmd, 1, [DS_RANK1, "missing", "DP rank 1", "dp_world_size 2"])


@case
def deepspeed_latest_nowhere(t):
    """`latest` naming a tag folder that does not exist, or a name that is no folder name, is
    refused naming the file and the tag; the tag folder given directly still reads."""
    d, tag = ds_copy(t, "nowhere")
    write(os.path.join(d, "latest"), b"global_step9")
    for cmd in ds_commands(d):
        run("deepspeed_latest_nowhere", cmd, 1, ["latest", "'global_step9'", "pointing nowhere"])
    write(os.path.join(d, "latest"), b"../global_step2\n")
    run("deepspeed_latest_nowhere", ["inspect", d], 1, ["latest", "'../global_step2'", "not a folder name"])
    run("deepspeed_latest_nowhere", ["verify", tag], 0)


@case
def deepspeed_partitions_disagree(t):
    """Partitions whose bookkeeping disagrees with param_shapes and the 2 x dp alignment: padding
    (group_paddings), DP world (partition_count), a parameter's place (param_slice_mappings) —
    each refused naming the file, the parameter or group and the rule."""
    for name, edits, words in (
            ("padding", [(b"group_paddings", b"K\x00K\x01e", b"K\x00K\x02e")],
             ["group_paddings[1] is 2", "disagree on padding", DS_RANK1]),
            ("count", [(b"partition_count", b"K\x02K\x02e", b"K\x02K\x03e")],
             ["partition_count[1] is 3", "2 DP ranks", DS_RANK1]),
            ("mapping", [(b"row.weight", b"htK&", b"htK'")],
             ["parameter 'row.weight'", "param_slice_mappings[0]", "[38, 88)", DS_RANK1])):
        d, tag = ds_copy(t, name)
        ds_patch_pickle(os.path.join(tag, DS_RANK1), edits)
        for cmd in ds_commands(d):
            run("deepspeed_partitions_disagree", cmd, 1, words)


@case
def deepspeed_foreign_global(t):
    """A global outside the torch.save allowlist and DeepSpeed's records (LossScaler renamed) is
    refused naming it; and DeepSpeed's own records are read by the deepspeed layout alone: the
    same optimizer file read as a torch.save file of its own is refused as before."""
    d, tag = ds_copy(t, "global")
    ds_patch_pickle(os.path.join(tag, DS_RANK1), [(b"loss_scaler\n", b"LossScaler\n", b"LossScalez\n")])
    for cmd in ds_commands(d):
        run("deepspeed_foreign_global", cmd, 1,
            [DS_RANK1, "'deepspeed.runtime.fp16.loss_scaler.LossScalez'", "allowlist"])
    good = os.path.join(DS_GOLDEN, "global_step2", DS_RANK1)
    for cmd in (["inspect", good], ["digest", good]):
        run("deepspeed_foreign_global", cmd, 1, ["global 'deepspeed.", "allowlist"])


DSU_GOLDEN = os.path.join(SOURCE, "tests", "fixtures", "peers", "zero1_bf16", "universal")
DSU3_GOLDEN = os.path.join(SOURCE, "tests", "fixtures", "peers", "zero3_bf16", "universal")


def dsu_copy(t, name, golden=DSU_GOLDEN):
    """A copy of a universal golden (the folder with `latest_universal`) under t/name; its zero/ folder."""
    d = os.path.join(t, name)
    shutil.copytree(golden, d)
    return d, os.path.join(d, open(os.path.join(d, "latest_universal")).read().strip(), "zero")


@case
def deepspeed_universal_missing_state(t):
    """A universal checkpoint (ds_to_universal's zero/<param>/ files) missing one parameter's
    exp_avg_sq.pt, or whose `latest_universal` names no tag folder: refused naming the file, the
    parameter and the rule (no parameter presented without its state)."""
    d, zero = dsu_copy(t, "missing")
    os.remove(os.path.join(zero, "row.weight", "exp_avg_sq.pt"))
    for cmd in ds_commands(d):
        run("deepspeed_universal_missing_state", cmd, 1,
            ["row.weight/exp_avg_sq.pt", "missing", "parameter 'row.weight'", "exp_avg_sq"])
    d, zero = dsu_copy(t, "nowhere")
    write(os.path.join(d, "latest_universal"), b"global_step9_universal")
    for cmd in ds_commands(d):
        run("deepspeed_universal_missing_state", cmd, 1,
            ["latest_universal", "'global_step9_universal'", "pointing nowhere"])


@case
def deepspeed_universal_shapes(t):
    """State files whose tensors are not what param_shapes says: a tensor of more elements than
    the parameter's, a parameter's exp_avg of another shape than its fp32 master, a step that is
    not 0-d, a ZeRO-3 flat master of another length; each refused naming the file, the parameter
    and the rule."""
    for name, src, dst, words in (
            ("bigger", "col.weight/fp32.pt", "row.weight/fp32.pt",
             ["row.weight/fp32.pt", "parameter 'row.weight'", "[10,6]", "param_shapes[0]'s [5,10]"]),
            ("disagree", "norm.weight/exp_avg.pt", "col.bias/exp_avg.pt",
             ["col.bias/exp_avg.pt", "parameter 'col.bias'", "[6] here, [10] in its fp32.pt", "disagree on shape"]),
            ("step", "norm.weight/fp32.pt", "norm.weight/step.pt",
             ["norm.weight/step.pt", "parameter 'norm.weight'", "0-d tensor"])):
        d, zero = dsu_copy(t, name)
        shutil.copyfile(os.path.join(zero, src), os.path.join(zero, dst))
        for cmd in ds_commands(d):
            run("deepspeed_universal_shapes", cmd, 1, words)
    d, zero = dsu_copy(t, "flat3", DSU3_GOLDEN)
    shutil.copyfile(os.path.join(zero, "col.bias", "fp32.pt"), os.path.join(zero, "col.weight", "fp32.pt"))
    for cmd in ds_commands(d):
        run("deepspeed_universal_shapes", cmd, 1,
            ["col.weight/fp32.pt", "parameter 'col.weight'", "[10]", "whole or flat (60 elements)"])


@case
def deepspeed_universal_foreign_global(t):
    """A universal state file whose pickle names a global outside the torch.save allowlist
    (collections.OrderedDict renamed) is refused naming the file and the global."""
    d, zero = dsu_copy(t, "global")
    ds_patch_pickle(os.path.join(zero, "embed.weight", "exp_avg.pt"), [(None, b"OrderedDict\n", b"OrderedDicz\n")])
    for cmd in ds_commands(d):
        run("deepspeed_universal_foreign_global", cmd, 1,
            ["embed.weight/exp_avg.pt", "'collections.OrderedDicz'", "allowlist"])
