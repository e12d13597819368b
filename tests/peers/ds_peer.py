#!/usr/bin/env python3
"""DeepSpeed as a peer: writes small ZeRO-1/2/3 checkpoints (and universal checkpoints made from
them by DeepSpeed's own ds_to_universal) together with the tensors they must hold, taken from the
live training engine, for shardsafe's reader tests.

Runs inside the Debian 13 root (scripts/env-debian13.sh make peers), on CPU with Gloo; DeepSpeed is
not installed, its source tree is put on PYTHONPATH (tests/peers/make_goldens.sh does this).

    python3 ds_peer.py CASE OUTDIR        CASE: one of CASES below; OUTDIR/CASE is (re)made

PEER_DS_SIZE=V,H,F,O,L (opt-in, for bench/trainer_converters.py): the same case with a larger
model (embedding V x H, L extra Linear(H, H) blocks after the norm, col F x H, row O x F); only the
checkpoint and expected/fp32.safetensors are written, and DeepSpeed's offline tools are not run
here (the bench runs and times them). Unset, nothing changes (the goldens).

What each case directory holds:
    ckpt/latest, ckpt/global_step2/...       what engine.save_checkpoint wrote (2 Adam steps)
    universal/global_step2_universal/...     ds_to_universal's output (the cases with universal=1)
    expected/module.safetensors              engine.module's parameters and buffers, full, in the
                                             module's dtype (what mp_rank_*_model_states.pt's
                                             'module' holds for ZeRO-1/2; gathered for ZeRO-3)
    expected/fp32.safetensors                the fp32 master of each trained parameter, full
                                             (deepspeed.utils.safe_get_full_fp32_param, live)
    expected/exp_avg.safetensors, expected/exp_avg_sq.safetensors
                                             Adam's state, full (safe_get_full_optimizer_state)
    expected/resume/                         DeepSpeed's own resume (without TP): a new engine's
                                             load_checkpoint on the same world, then step 3 on the next
                                             batch: grad.safetensors (the averaged fp32 gradient it
                                             stepped with) and fp32 / exp_avg / exp_avg_sq after the
                                             step, full; written only where torch's AdamW, stepped from
                                             the saved state with that gradient, gives DeepSpeed's step
                                             bit for bit (not ZeRO-1's BF16_Optimizer: meta.json says)
    expected/meta.json                       versions, case, world, step, what was checked
With tensor parallelism (tp2) the expected files are per TP rank: expected/tp{R}/..., each the
rank's piece as DeepSpeed holds it (DeepSpeed itself never joins TP pieces; how to join them is
the model's business: here weights of 'col.*' are split on dim 0, of 'row.*' on dim 1, the rest
replicated), and expected/joined/ holds the joined tensors.
"""
import json
import os
import shutil
import socket
import subprocess
import sys

from resume_golden import adamw_replay_differs, write_resume

CASES = {
    # name: zero stage, dtype, dp, tp, universal, extra config
    "zero1_bf16": dict(stage=1, dtype="bf16", dp=2, tp=1, universal=True),
    "zero2_fp32": dict(stage=2, dtype="fp32", dp=2, tp=1, universal=False),
    "zero2_bf16_tp2": dict(stage=2, dtype="bf16", dp=2, tp=2, universal=True),
    "zero3_bf16": dict(stage=3, dtype="bf16", dp=2, tp=1, universal=True),
}


# PEER_DS_SIZE: V,H,F,O,L of a larger model for the bench (module docstring); None: the goldens
SIZE = tuple(int(x) for x in os.environ["PEER_DS_SIZE"].split(",")) if os.environ.get("PEER_DS_SIZE") else None


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


# ---------------------------------------------------------------------------------------------
# the worker: one rank


def worker(case_name, outdir):
    import torch
    import torch.nn as nn
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_get_full_grad

    # DeepSpeed's CPU accelerator JIT-compiles its shared-memory all-reduce (deepspeed_shm_comm)
    # whenever a compiler is there; the peer does not build DeepSpeed's C++: the op is marked not
    # compatible, and DeepSpeed uses plain torch.distributed (Gloo) collectives instead
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.ops.__compatible_ops__["deepspeed_ccl_comm"] = False

    case = CASES[case_name]
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    tp, dp = case["tp"], case["dp"]
    assert world == tp * dp
    deepspeed.init_distributed(dist_backend="gloo")
    tp_rank = rank % tp
    dp_rank = rank // tp

    mpu = None
    if tp > 1:
        # Megatron's rank order: TP groups are consecutive ranks, DP groups stride by tp
        tp_groups = [dist.new_group(list(range(d * tp, d * tp + tp))) for d in range(dp)]
        dp_groups = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]

        class MPU:
            """The part of Megatron's mpu that DeepSpeed asks for."""

            def get_model_parallel_rank(self):
                return tp_rank

            def get_model_parallel_world_size(self):
                return tp

            def get_model_parallel_group(self):
                return tp_groups[dp_rank]

            get_tensor_model_parallel_rank = get_model_parallel_rank
            get_tensor_model_parallel_world_size = get_model_parallel_world_size
            get_tensor_model_parallel_group = get_model_parallel_group

            def get_tensor_model_parallel_src_rank(self):
                return dp_rank * tp

            def get_data_parallel_rank(self):
                return dp_rank

            def get_data_parallel_world_size(self):
                return dp

            def get_data_parallel_group(self):
                return dp_groups[tp_rank]

            def get_data_parallel_group_ranks(self):
                return list(range(tp_rank, world, tp))

        mpu = MPU()

    # the model: the full model is made from one seed on every rank, then each TP rank keeps its
    # piece; odd sizes so that the flat partitions need padding
    torch.manual_seed(1234)
    V, H, F, O = 11, 6, 10, 5
    L = 0
    if SIZE:
        V, H, F, O, L = SIZE

    class CopyToTP(torch.autograd.Function):
        """Megatron's copy_to_tensor_model_parallel_region: identity, gradients summed over TP."""

        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, g):
            g = g.contiguous()
            torch.distributed.all_reduce(g, group=mpu.get_model_parallel_group())
            return g

    class ReduceFromTP(torch.autograd.Function):
        """Megatron's reduce_from_tensor_model_parallel_region: summed over TP, gradient as is."""

        @staticmethod
        def forward(ctx, x):
            x = x.contiguous().clone()
            torch.distributed.all_reduce(x, group=mpu.get_model_parallel_group())
            return x

        @staticmethod
        def backward(ctx, g):
            return g

    class Tiny(nn.Module):

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(V, H)
            self.norm = nn.LayerNorm(H)
            self.col = nn.Linear(H, F)  # column parallel under TP: weight and bias split on dim 0
            self.row = nn.Linear(F, O)  # row parallel under TP: weight split on dim 1, bias whole
            self.frozen = nn.Parameter(torch.randn(3, 4), requires_grad=False)
            self.register_buffer("counter", torch.arange(4, dtype=torch.int64))
            if L:
                self.blocks = nn.ModuleList([nn.Linear(H, H) for _ in range(L)])

        def forward(self, ids):
            x = self.norm(self.embed(ids))
            for b in (self.blocks if L else ()):
                x = torch.relu(b(x))
            if tp > 1:
                x = CopyToTP.apply(x)
            h = torch.relu(torch.nn.functional.linear(x, self.col.weight, self.col.bias))
            y = torch.nn.functional.linear(h, self.row.weight)
            if tp > 1:
                y = ReduceFromTP.apply(y)
            return y + self.row.bias + self.frozen.sum() * 0

    def make_model():
        model = Tiny()
        if tp > 1:
            with torch.no_grad():
                f = F // tp
                model.col.weight = nn.Parameter(model.col.weight[tp_rank * f:(tp_rank + 1) * f].clone())
                model.col.bias = nn.Parameter(model.col.bias[tp_rank * f:(tp_rank + 1) * f].clone())
                model.row.weight = nn.Parameter(model.row.weight[:, tp_rank * f:(tp_rank + 1) * f].clone())
                for n, p in model.named_parameters():
                    if n.startswith("col.") or n == "row.weight":
                        p.tensor_model_parallel = True  # what Megatron marks; DeepSpeed reads it for norms
                        p.partition_dim = 1 if n == "row.weight" else 0
        return model

    model = make_model()

    def make_optimizer(model):
        decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() == 2]
        no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() != 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                  {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)

    opt = make_optimizer(model)

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": case["stage"]},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
    }
    if case["dtype"] == "bf16":
        config["bf16"] = {"enabled": True}
        if case["stage"] == 1:
            # ZeRO-1 with bf16 weights and fp32 gradient accumulation: DeepSpeed's BF16_Optimizer,
            # whose optimizer files are named bf16_zero_pp_rank_*
            config["data_types"] = {"grad_accum_dtype": "fp32"}
    if case["stage"] == 3:
        config["zero_optimization"].update({"stage3_param_persistence_threshold": 0,
                                            "stage3_gather_16bit_weights_on_model_save": True})

    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config, mpu=mpu)
    dt = torch.bfloat16 if case["dtype"] == "bf16" else torch.float32
    g = torch.Generator().manual_seed(100 + dp_rank)  # each DP rank its own data
    for step in range(2):
        ids = torch.randint(0, V, (2, 3), generator=g)
        target = torch.randn(2, 3, O, generator=g).to(dt)
        out = engine(ids)
        loss = ((out.float() - target.float())**2).mean()
        engine.backward(loss)
        engine.step()

    ckpt = os.path.join(outdir, "ckpt")
    client_state = {"iteration": 2}
    if tp > 1:
        # what Megatron-DeepSpeed records for ds_to_universal: how the TP pieces join
        client_state["universal_checkpoint_info"] = {
            "universal_checkpoint_version": 0.2,
            "tp_replicated_parameter_patterns": [r"^embed\.weight$", r"^norm\..*", r"^row\.bias$"],
            "parameter_with_row_parallelism_patterns": [r"^row\.weight$"],
        }
    engine.save_checkpoint(ckpt, client_state=client_state)

    # the expected tensors, from the live engine (collectives: every rank takes part).
    # ZeRO-1/2 steps one param group at a time and links the parameters' views of the optimizer
    # state after the first group's step, when the later groups have no state yet: with two
    # groups the second group's exp_avg views stay empty. Linked again here, all groups have state.
    def relink(optimizer):
        if hasattr(optimizer, "_hp_optimizer_states_linked"):
            optimizer._hp_optimizer_states_linked = False
            optimizer._lazy_init_hp_params_optimizer_state()

    relink(optimizer)
    import safetensors.torch as st
    fp32, ea, eas, module = {}, {}, {}, {}
    for n, p in engine.module.named_parameters():
        if p.requires_grad:
            fp32[n] = safe_get_full_fp32_param(p).detach().clone().cpu()
            if SIZE:
                continue  # the bench takes the fp32 masters only
            ea[n] = safe_get_full_optimizer_state(p, "exp_avg").detach().clone().cpu()
            eas[n] = safe_get_full_optimizer_state(p, "exp_avg_sq").detach().clone().cpu()
    if SIZE:
        if dp_rank == 0:
            os.makedirs(os.path.join(outdir, "expected"), exist_ok=True)
            st.save_file(fp32, os.path.join(outdir, "expected", "fp32.safetensors"))
        dist.barrier()
        return
    if case["stage"] == 3:
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
            for n, p in engine.module.named_parameters():
                module[n] = p.detach().clone().cpu()
    else:
        for n, p in engine.module.named_parameters():
            module[n] = p.detach().clone().cpu()
    for n, b in engine.module.named_buffers():
        module[n] = b.detach().clone().cpu()
    for n in fp32:
        # seen once in ten runs: ZeRO-3's gather gave a garbage row.weight (1e33), while the fp32
        # masters were right; such a run is refused, not committed
        if not torch.equal(module[n], fp32[n].to(module[n].dtype)):
            raise SystemExit(f"{case_name}: the module's {n} is not its fp32 master cast to "
                             f"{module[n].dtype} (a DeepSpeed gather gone wrong): run the case again")
    step_count = None
    base = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    for s in base.state.values():
        if "step" in s:
            step_count = float(s["step"])
            break
    if dp_rank == 0:
        sub = os.path.join(outdir, "expected", f"tp{tp_rank}") if tp > 1 else os.path.join(outdir, "expected")
        os.makedirs(sub, exist_ok=True)
        st.save_file({k: v.contiguous() for k, v in module.items()}, os.path.join(sub, "module.safetensors"))
        st.save_file(fp32, os.path.join(sub, "fp32.safetensors"))
        st.save_file(ea, os.path.join(sub, "exp_avg.safetensors"))
        st.save_file(eas, os.path.join(sub, "exp_avg_sq.safetensors"))
        with open(os.path.join(sub, "step.json"), "w") as f:
            json.dump({"adam_step": step_count, "optimizer": type(optimizer).__name__,
                       "base_optimizer": type(base).__name__}, f)
    dist.barrier()

    # DeepSpeed's own resume (without TP): a new engine loads the checkpoint just written, on the
    # same world, and takes step 3 on each DP rank's next batch. What it stepped with (the averaged
    # fp32 gradient) and the state after the step are the golden of a resumed job: expected/resume/
    if tp > 1:
        return
    model2 = make_model()
    engine2, optimizer2, _, _ = deepspeed.initialize(model=model2, optimizer=make_optimizer(model2), config=config,
                                                     mpu=mpu)
    engine2.load_checkpoint(ckpt)
    relink(optimizer2)
    for n, p in engine2.module.named_parameters():
        if p.requires_grad:
            assert torch.equal(safe_get_full_fp32_param(p).cpu(), fp32[n]), f"resumed fp32 of {n} differs"
            assert torch.equal(safe_get_full_optimizer_state(p, "exp_avg").cpu(), ea[n]), f"resumed exp_avg of {n}"
            assert torch.equal(safe_get_full_optimizer_state(p, "exp_avg_sq").cpu(), eas[n]), f"resumed exp_avg_sq {n}"
    ids = torch.randint(0, V, (2, 3), generator=g)
    target = torch.randn(2, 3, O, generator=g).to(dt)
    out = engine2(ids)
    loss = ((out.float() - target.float())**2).mean()
    engine2.backward(loss)
    grad = {}
    for n, p in engine2.module.named_parameters():
        if p.requires_grad:
            grad[n] = safe_get_full_grad(p).detach().float().clone().cpu()
    engine2.step()
    relink(optimizer2)
    after = {"fp32": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for n, p in engine2.module.named_parameters():
        if p.requires_grad:
            after["fp32"][n] = safe_get_full_fp32_param(p).detach().clone().cpu()
            after["exp_avg"][n] = safe_get_full_optimizer_state(p, "exp_avg").detach().clone().cpu()
            after["exp_avg_sq"][n] = safe_get_full_optimizer_state(p, "exp_avg_sq").detach().clone().cpu()
    if dp_rank == 0:
        # the gradient recorded is the one DeepSpeed stepped with: torch's AdamW, stepped from the
        # saved state with it, gives DeepSpeed's state after the step, bit for bit
        differ = adamw_replay_differs({n: (fp32[n], ea[n], eas[n]) for n in grad}, grad, after, step_count,
                                      lambda n: {"lr": 1e-2, "weight_decay": 0.01 if fp32[n].dim() == 2 else 0.0})
        if differ:
            # no golden from a gradient that does not give DeepSpeed's step (ZeRO-1's BF16_Optimizer)
            with open(os.path.join(outdir, "resume_refused.txt"), "w") as f:
                f.write("torch's AdamW stepped with safe_get_full_grad's gradient differs from DeepSpeed's "
                        f"resumed step in {len(differ)} of {3 * len(grad)} tensors (" + ", ".join(differ[:3]) + ", ...)")
            dist.barrier()
            return
        write_resume(outdir, grad, after,
                     {"adam_step": step_count + 1, "resumed_from": "ckpt/global_step2", "dp": dp,
                      "checked": "torch.optim.AdamW(foreach=False) stepped from the saved state with grad "
                                 "== DeepSpeed's state after its resumed step (bitwise)"})
    dist.barrier()


# ---------------------------------------------------------------------------------------------
# the driver


def run_case(name, root):
    case = CASES[name]
    out = os.path.join(root, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    world = case["dp"] * case["tp"]
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu", USE_LIBUV="0",
                   OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        log = open(os.path.join(root, f"{name}.rank{r}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", name, out], env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
    rcs = [p.wait(timeout=900) for p in procs]
    if any(rcs):
        raise SystemExit(f"{name}: workers exited {rcs}; logs in {root}/{name}.rank*.log")
    if not SIZE:
        check_offline(name, out)


def check_offline(name, out):
    """DeepSpeed's own offline tools on the files just written: zero_to_fp32 must give the live
    fp32 masters bit for bit; ds_to_universal writes the universal checkpoint."""
    import torch
    import safetensors.torch as st
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    import deepspeed

    case = CASES[name]
    ckpt = os.path.join(out, "ckpt")
    meta = {"case": name, **{k: v for k, v in case.items()}, "deepspeed_version": deepspeed.__version__,
            "deepspeed_commit": os.environ.get("PEER_DS_COMMIT", "?"), "torch_version": torch.__version__,
            "checks": []}
    if case["tp"] == 1:
        want = st.load_file(os.path.join(out, "expected", "fp32.safetensors"))
        mod = st.load_file(os.path.join(out, "expected", "module.safetensors"))
        try:
            got = get_fp32_state_dict_from_zero_checkpoint(ckpt)
        except ValueError as e:
            # BF16_Optimizer's files (bf16_zero_pp_rank_*) have no 'zero_stage' in their
            # optimizer_state_dict: zero_to_fp32 refuses them
            meta["checks"].append(f"zero_to_fp32 refuses this checkpoint: {e}".replace(out, "<case>"))
            got = None
        if got is not None:
            for n, t in want.items():
                assert torch.equal(got[n], t), f"zero_to_fp32 differs from live fp32 for {n}"
            # frozen parameters come back too, from the module file, in fp32
            assert torch.equal(got["frozen"], mod["frozen"].float())
            meta["checks"].append("zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint == live fp32 masters"
                                  " (bitwise), frozen param == module's")
    else:
        # join the TP pieces the way the model splits them
        joined = {}
        for kind in ("module", "fp32", "exp_avg", "exp_avg_sq"):
            parts = [st.load_file(os.path.join(out, "expected", f"tp{r}", f"{kind}.safetensors"))
                     for r in range(case["tp"])]
            j = {}
            for n in parts[0]:
                if n.startswith("col."):
                    j[n] = torch.cat([p[n] for p in parts], 0)
                elif n == "row.weight":
                    j[n] = torch.cat([p[n] for p in parts], 1)
                else:
                    for p in parts[1:]:
                        assert torch.equal(p[n], parts[0][n]), f"replicated {n} differs across TP ranks"
                    j[n] = parts[0][n]
            os.makedirs(os.path.join(out, "expected", "joined"), exist_ok=True)
            st.save_file({k: v.contiguous() for k, v in j.items()},
                         os.path.join(out, "expected", "joined", f"{kind}.safetensors"))
            joined[kind] = j
        meta["checks"].append("replicated params equal on both TP ranks (module, fp32, exp_avg, exp_avg_sq)")
    refused = os.path.join(out, "resume_refused.txt")
    if os.path.exists(os.path.join(out, "expected", "resume")):
        meta["checks"].append("resumed by DeepSpeed (load_checkpoint, same world) == saved state (bitwise); its step 3's "
                              "gradient and state after it in expected/resume/, torch's AdamW replay of that step "
                              "== DeepSpeed's (bitwise)")
    elif os.path.exists(refused):
        with open(refused) as f:
            meta["checks"].append("no resume golden: " + f.read())
        os.remove(refused)
    if case["universal"]:
        uni = os.path.join(out, "universal", "global_step2_universal")
        tag = os.path.join(ckpt, "global_step2")
        r = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", tag,
                            "--output_folder", uni, "--num_extract_workers", "1", "--num_merge_workers", "1",
                            "--inject_missing_state"], capture_output=True, text=True)
        with open(os.path.join(os.path.dirname(out), f"{name}.universal.log"), "w") as f:
            f.write(r.stdout + r.stderr)
        if r.returncode != 0:
            raise SystemExit(f"{name}: ds_to_universal failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        with open(os.path.join(out, "universal", "latest_universal"), "w") as f:
            f.write("global_step2_universal")
        # the universal files against the live tensors
        base = os.path.join(out, "expected") if case["tp"] == 1 else os.path.join(out, "expected", "joined")
        for kind, fname in (("fp32", "fp32"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            want = st.load_file(os.path.join(base, f"{kind}.safetensors"))
            for n, t in want.items():
                obj = torch.load(os.path.join(uni, "zero", n, f"{fname}.pt"), weights_only=False)
                got = obj["param"] if isinstance(obj, dict) else obj
                if case["stage"] == 3:
                    # ZeRO-3's universal files hold a bare 1-D tensor, unpadded, without the shape
                    assert got.dim() == 1 and got.numel() == t.numel(), f"universal {n}: {got.shape}"
                    got = got.view(t.shape)
                assert torch.equal(got, t), f"universal {n}/{fname}.pt differs from live {kind}"
        meta["checks"].append("universal zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt == live tensors (bitwise)")
    with open(os.path.join(out, "expected", "meta.json"), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
    print(f"{name}: ok: {'; '.join(meta['checks'])}")


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        names = list(CASES) if sys.argv[1] == "all" else sys.argv[1].split(",")
        for n in names:
            run_case(n, sys.argv[2])
