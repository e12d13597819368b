"""Hostile cases of Megatron-Core torch_dist checkpoints (issue 54, checkpoint/layouts/megatron_dist.hpp):
the golden tests/fixtures/peers/mcore_gpt_tp2_pp2/torch_dist (Megatron-Core 0.16.1's own files)
copied and broken one way each; loaded by hostile.py, with its helpers (run, case, write, ...) in
scope."""
import os
import shutil
import sys

MC_GOLDEN = os.path.join(SOURCE, "tests", "fixtures", "peers", "mcore_gpt_tp2_pp2", "torch_dist")
MC_TRACKER = "latest_checkpointed_iteration.txt"


def mc_copy(t, name):
    """A copy of the torch_dist golden (the folder with the tracker) under t/name; its iteration folder."""
    d = os.path.join(t, name)
    shutil.copytree(MC_GOLDEN, d)
    return d, os.path.join(d, "iter_0000002")


def mc_patch_pickle(path, edits):
    """patch_data_pkl (tests/torch_archive_edit.py) on the torch.save archive at path."""
    sys.path.insert(0, os.path.join(HERE, ".."))
    from torch_archive_edit import patch_data_pkl
    patch_data_pkl(path, edits)


def mc_commands(d):
    return (["inspect", d], ["verify", d], ["digest", d])


@case
def megatron_tracker_nowhere(t):
    """latest_checkpointed_iteration.txt naming an iteration with no folder, or something that is
    neither a number nor 'release': refused naming the file and what it says; the iteration folder
    given directly still reads."""
    d, it = mc_copy(t, "nowhere")
    write(os.path.join(d, MC_TRACKER), b"9\n")
    for cmd in mc_commands(d):
        run("megatron_tracker_nowhere", cmd, 1, [MC_TRACKER, "iter_0000009", "pointing nowhere"])
    write(os.path.join(d, MC_TRACKER), b"../iter_0000002")
    run("megatron_tracker_nowhere", ["inspect", d], 1, [MC_TRACKER, "'../iter_0000002'", "neither an iteration"])
    run("megatron_tracker_nowhere", ["verify", it], 0)


@case
def megatron_common_lies(t):
    """common.pt missing, holding a class outside the allowlist and Megatron's records (the args'
    argparse.Namespace renamed), and a metadata.json naming another backend: each refused by every
    command naming the file and the rule."""
    d, it = mc_copy(t, "missing")
    os.remove(os.path.join(it, "common.pt"))
    for cmd in mc_commands(d):
        run("megatron_common_lies", cmd, 1, ["common.pt", "missing"])
    d, it = mc_copy(t, "global")
    mc_patch_pickle(os.path.join(it, "common.pt"), [(None, b"Namespace\n", b"Namespacf\n")])
    for cmd in mc_commands(d):
        run("megatron_common_lies", cmd, 1, ["common.pt", "'argparse.Namespacf'", "allowlist"])
    d, it = mc_copy(t, "backend")
    write(os.path.join(it, "metadata.json"), b'{"sharded_backend": "zarr", "sharded_backend_version": 1}')
    for cmd in mc_commands(d):
        run("megatron_common_lies", cmd, 1, ["metadata.json", "sharded_backend \"zarr\"", "torch_dist"])


@case
def megatron_missing_data_file(t):
    """A torch_dist checkpoint missing one rank's data file: refused by every command that reads it,
    naming the file and .metadata; inspect (the description alone) still lists the tensors."""
    d, it = mc_copy(t, "data")
    os.remove(os.path.join(it, "__1_0.distcp"))
    run("megatron_missing_data_file", ["inspect", d], 0)
    for cmd in (["verify", d], ["digest", d]):
        run("megatron_missing_data_file", cmd, 1, ["__1_0.distcp", "missing", ".metadata"])


@case
def megatron_reformulated(t):
    """A DCP .metadata of Megatron-Core 0.15 and before (MCoreMetadata) reads as any DCP folder;
    a key its mcore_data records as reformulated flattened ranges (nd_reformulated_orig_global_shape:
    stored [1, 1, 12] for a [3, 4] tensor) is listed but never read as the shape it is stored in:
    verify and digest refuse it naming the key, the rule and how to re-save."""
    values = [float(v) for v in range(12)]
    d = os.path.join(t, "plain")
    dcp_f32_folder(d, [3, 4], [([0, 0], [3, 4], [4, 1], values)], mcore_data={})
    for cmd in (["inspect", d], ["verify", d], ["digest", d]):
        run("megatron_reformulated", cmd, 0)
    d = os.path.join(t, "reformulated")
    dcp_f32_folder(d, [1, 1, 12], [([0, 0, 0], [1, 1, 12], [12, 12, 1], values)],
                   mcore_data={"w": {"nd_reformulated_orig_global_shape": (3, 4)}})
    run("megatron_reformulated", ["inspect", d], 0)
    for cmd in (["verify", d], ["digest", d]):
        run("megatron_reformulated", cmd, 1, ["'w'", "reformulated flattened ranges", "re-save"])


MC_LEGACY = os.path.join(SOURCE, "tests", "fixtures", "peers", "{}", "legacy")


def mc_legacy_copy(t, name, golden="mcore_gpt_tp2_pp2"):
    """A copy of a legacy golden (the folder with the tracker) under t/name; its iteration folder."""
    d = os.path.join(t, name)
    shutil.copytree(MC_LEGACY.format(golden), d)
    return d, os.path.join(d, "iter_0000002")


@case
def megatron_legacy_missing_rank(t):
    """A legacy checkpoint (mp_rank_TT_PPP/model_optim_rng.pt) missing one rank's folder: refused by
    every command naming the file, the rank and the world the args give."""
    d, it = mc_legacy_copy(t, "missing")
    shutil.rmtree(os.path.join(it, "mp_rank_01_001"))
    for cmd in mc_commands(d):
        run("megatron_legacy_missing_rank", cmd, 1,
            ["mp_rank_01_001", "model_optim_rng.pt", "missing", "TP rank 1, stage 1", "TP 2 x PP 2 x EP 1"])


@case
def megatron_legacy_args_lie(t):
    """args that disagree with the folder names (pipeline_model_parallel_size 1 beside mp_rank_TT_PPP
    folders), a class outside the allowlist and Megatron's records (argparse.Namespacf): refused
    naming the file and the rule."""
    d, it = mc_legacy_copy(t, "pp")
    mc_patch_pickle(os.path.join(it, "mp_rank_00_000", "model_optim_rng.pt"),
                    [(b"pipeline_model_parallel_sizeq", b"K\x02", b"K\x01")])
    for cmd in mc_commands(d):
        run("megatron_legacy_args_lie", cmd, 1, ["mp_rank_00_000", "PP 1", "rank 0 folder is mp_rank_00,"])
    d, it = mc_legacy_copy(t, "global")
    mc_patch_pickle(os.path.join(it, "mp_rank_01_000", "model_optim_rng.pt"), [(None, b"Namespace\n", b"Namespacf\n")])
    for cmd in mc_commands(d):
        run("megatron_legacy_args_lie", cmd, 1, ["mp_rank_01_000", "'argparse.Namespacf'", "allowlist"])


@case
def megatron_legacy_optimizer_lies(t):
    """Optimizer state the rules cannot name: a param group whose kind is not its parameters'
    (wd_mult 1.0 made 0.0: 9 weights listed in a group of biases), and a distributed optimizer's buffer whose numel_unpadded is not where the parameters
    end: refused naming the file, the group or buffer and the rule."""
    d, it = mc_legacy_copy(t, "groups")
    mc_patch_pickle(os.path.join(it, "mp_rank_01_001", "model_optim_rng.pt"),
                    [(b"wd_mult", b"G?\xf0\x00\x00\x00\x00\x00\x00", b"G\x00\x00\x00\x00\x00\x00\x00\x00")])
    for cmd in mc_commands(d):
        run("megatron_legacy_optimizer_lies", cmd, 1,
            ["mp_rank_01_001", "optimizer.param_groups.0", "lists 9 parameters", "grouping rule"])
    d, it = mc_legacy_copy(t, "buffer", "mcore_distopt_tp2_dp2")
    mc_patch_pickle(os.path.join(it, "mp_rank_01", "distrib_optim.pt"), [(b"numel_unpadded", b"M\xc0\x07", b"M\xc1\x07")])
    for cmd in mc_commands(d):
        run("megatron_legacy_optimizer_lies", cmd, 1,
            ["mp_rank_01/distrib_optim.pt", "end at 1984", "numel_unpadded is 1985", "laid out otherwise"])


@case
def megatron_legacy_bf16_wrapper_lies(t):
    """A bf16 run's legacy file (Float16OptimizerWithFloat16Params: the torch optimizer's state under
    'optimizer', the fp32 masters beside it) whose masters list is renamed away: not the wrapper,
    refused naming the file and what is missing, never read as the fp32 optimizer."""
    d, it = mc_legacy_copy(t, "wrapper", "mcore_gpt_bf16_tp2")
    mc_patch_pickle(os.path.join(it, "mp_rank_01", "model_optim_rng.pt"),
                    [(None, b"fp32_from_fp16_params", b"fp32_from_fp16_paramz")])
    for cmd in mc_commands(d):
        run("megatron_legacy_bf16_wrapper_lies", cmd, 1,
            ["mp_rank_01/model_optim_rng.pt", "no fp32_from_fp16_params list", "Float16OptimizerWithFloat16Params"])
