#!/usr/bin/env python3
"""Megatron-LM as a peer: a tiny Megatron-Core GPT (tensor parallel 2 x pipeline parallel 2, GQA,
SwiGLU, padded vocabulary; and a 4-expert MoE GPT on 2 expert-parallel ranks), two Adam steps, then Megatron's own save_checkpoint writes it twice:
as torch_dist (Megatron-Core dist_checkpointing over torch DCP) and as the legacy torch format
(mp_rank_TT_PPP/model_optim_rng.pt). Megatron's own dist_checkpointing.load then reads the
torch_dist checkpoint back into a TP1 PP1 model, which gives the full tensors.

Runs inside the Debian 13 root (scripts/env-debian13.sh make peers), CPU and Gloo; Megatron-LM is
not installed, its source tree is on PYTHONPATH (tests/peers/make_goldens.sh mcore SRC).

    python3 mcore_peer.py CASE OUTDIR

PEER_MCORE_SIZE=HIDDEN,FFN,LAYERS,VOCAB (opt-in, for bench/trainer_converters.py): the same case with
a larger model; only torch_dist/ and legacy/ are written (no expected/, no TP1 PP1 load, no checks).
Unset, nothing changes (the goldens).

OUTDIR/CASE holds:
    torch_dist/latest_checkpointed_iteration.txt, torch_dist/iter_0000002/...
    legacy/latest_checkpointed_iteration.txt, legacy/iter_0000002/mp_rank_TT_PPP/model_optim_rng.pt
    expected/local/tp{T}_pp{P}[_ep{E}]/{model,exp_avg,exp_avg_sq}.safetensors
        what each rank held when it saved: its model chunk's state_dict_for_save_checkpoint()
        (local layer numbers, TP pieces, fused linear_qkv / linear_fc1 as Megatron keeps them)
        and Adam's state for each of its parameters, under the parameter's local name
    expected/full/{model,exp_avg,exp_avg_sq}.safetensors
        the torch_dist checkpoint loaded by Megatron into a TP1 PP1 EP1 model of the same shape
        (global layer and expert numbers, whole tensors): what a reader that joins the pieces
        must give; checkpoint_keys.json: each module name's checkpoint key (ShardedTensor.key),
        prepended axes and offsets
    expected/resume/{grad,fp32,exp_avg,exp_avg_sq}.safetensors, step.json
        Megatron's own resume of that load: each parameter's saved step, then step 3 with the
        peer's gradients (grad), and the state after it (fp32: the weights), under module names;
        torch's AdamW replays it bit for bit (checked here)
    expected/meta.json
What does not run on CPU and what the peer does instead is in tests/peers/README.md.
"""
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys

from resume_golden import adamw_replay_differs, write_resume

CASES = {
    "mcore_gpt_tp2_pp2": dict(tp=2, pp=2, ep=1, experts=0, layers=4),
    # MoE: 4 experts on 2 expert-parallel ranks (TP 1, PP 1: DP 2 = EP 2)
    "mcore_moe_ep2": dict(tp=1, pp=1, ep=2, experts=4, layers=2),
    # Megatron's distributed optimizer (TP 2 x DP 2), saved as torch_dist dp_reshardable (the
    # default), torch_dist fully_reshardable and legacy torch (distrib_optim.pt)
    "mcore_distopt_tp2_dp2": dict(tp=2, pp=1, ep=1, experts=0, layers=2, dp=2, distopt=True),
    # bf16 training (--bf16): bf16 weights, Megatron's Float16OptimizerWithFloat16Params keeping
    # fp32 masters (fp32_from_fp16_params), the common configuration of real runs
    "mcore_gpt_bf16_tp2": dict(tp=2, pp=1, ep=1, experts=0, layers=2, bf16=True),
}
ORIG_VOCAB = 13  # padded by Megatron to a multiple of make_vocab_size_divisible_by * tp
# PEER_MCORE_SIZE: hidden, ffn, layers, vocab of a larger model for the bench; None: the goldens
SIZE = tuple(int(x) for x in os.environ["PEER_MCORE_SIZE"].split(",")) if os.environ.get("PEER_MCORE_SIZE") else None
if SIZE:
    ORIG_VOCAB = SIZE[3]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def cpu_shims():
    """Megatron-LM calls a few CUDA functions on paths that have nothing to do on CPU; made
    harmless here, in the peer's process only (Megatron's files are not changed)."""
    import types
    import torch
    # megatron.training.initialize imports Megatron's batch-invariant Triton kernels at module
    # level (never used here); Debian has no Triton, and a fake triton package would mislead
    # torch itself: that one module of Megatron's is stood in for by an empty one
    m = types.ModuleType("megatron.core.transformer.custom_layers.batch_invariant_kernels")

    def stand_in(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *a, **k: None

    m.__getattr__ = stand_in
    sys.modules[m.__name__] = m
    # dist_checkpointing's FileSystemWriterAsync.preload_tensors synchronizes the device
    torch.cuda.synchronize = lambda *a, **k: None
    # get_rng_state stores torch.cuda.get_rng_state(): an empty byte tensor stands for it
    torch.cuda.get_rng_state = lambda *a, **k: torch.zeros(0, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda *a, **k: None
    # dist_checkpointing puts its small all-reduced flags on torch.cuda.current_device()
    torch.cuda.current_device = lambda: "cpu"
    # validate_args asks for the GPU's architecture (TP needs CUDA_DEVICE_MAX_CONNECTIONS=1 before
    # Blackwell): answered as a Hopper, and the variable is set
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(major=9, minor=0, name="none",
                                                                             total_memory=0)


def on_cpu():
    """For Megatron's distributed optimizer and DDP (CUDA-only as written): inside this context,
    tensors asked for on 'cuda' are made on the CPU, and Tensor.type() answers 'torch.cuda.X' for
    a CPU tensor (DistributedOptimizer checks its parameters' type strings), and .cuda() is the
    identity."""
    import contextlib
    import torch

    @contextlib.contextmanager
    def ctx():
        saved = {n: getattr(torch, n) for n in ("tensor", "zeros", "empty", "ones", "full")}
        real_type = torch.Tensor.type

        def wrap(f):
            def g(*a, **k):
                if str(k.get("device", "")).startswith("cuda"):
                    k["device"] = "cpu"
                return f(*a, **k)
            return g

        def fake_type(self, *a, **k):
            if a or k:
                return real_type(self, *a, **k)
            t = real_type(self)
            return t if self.is_cuda else t.replace("torch.", "torch.cuda.", 1)

        real_cuda = torch.Tensor.cuda
        for n, f in saved.items():
            setattr(torch, n, wrap(f))
        torch.Tensor.type = fake_type
        torch.Tensor.cuda = lambda self, *a, **k: self  # gathers for fully_reshardable
        try:
            yield
        finally:
            for n, f in saved.items():
                setattr(torch, n, f)
            torch.Tensor.type = real_type
            torch.Tensor.cuda = real_cuda

    return ctx()


def megatron_args(case, world, save, fmt, tp, pp, ep=1):
    from megatron.training.arguments import parse_args, validate_args
    sys.argv = [
        "pretrain_gpt.py", "--num-layers", str(case["layers"]), "--hidden-size", "8", "--ffn-hidden-size", "12",
        "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2", "--swiglu",
        "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1",
        "--global-batch-size", "1", "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size",
        str(pp), "--use-cpu-initialization", "--no-gradient-accumulation-fusion", "--transformer-impl", "local",
        "--untie-embeddings-and-output-weights", "--normalization", "LayerNorm", "--lr", "1e-2", "--train-iters",
        "2", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(ORIG_VOCAB), "--make-vocab-size-divisible-by",
        "4", "--save", save, "--ckpt-format", fmt, "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
        "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm", "--clip-grad", "0",
        "--weight-decay", "0.01", "--seed", "1234", "--save-interval", "2", "--eval-iters", "0", "--no-save-optim"
        if False else "--bf16", "--dist-ckpt-strictness", "log_all"
    ]
    if not case.get("bf16"):
        sys.argv.remove("--bf16")  # fp32 training (FP32Optimizer)
    if SIZE:
        for flag, v in (("--hidden-size", SIZE[0]), ("--ffn-hidden-size", SIZE[1]), ("--num-layers", SIZE[2])):
            sys.argv[sys.argv.index(flag) + 1] = str(v)
    if case["experts"]:
        sys.argv += ["--num-experts", str(case["experts"]), "--expert-model-parallel-size", str(ep),
                     "--moe-router-topk", "2", "--moe-ffn-hidden-size", "12"]
    i = sys.argv.index("--global-batch-size")
    sys.argv[i + 1] = str(world // (tp * pp))  # one micro batch per DP rank
    args = parse_args()
    args.rank = int(os.environ.get("RANK", "0"))
    args.world_size = world
    validate_args(args, {})
    from megatron.training.tokenizer.tokenizer import _vocab_size_with_padding
    args.padded_vocab_size = _vocab_size_with_padding(ORIG_VOCAB, args, logging_enabled=False)
    return args


def build(args, tp, pp, ep=1):
    import torch
    from megatron.core import mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training.arguments import core_transformer_config_from_args
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  expert_model_parallel_size=ep)
    # use_cpu_initialization: every rank draws the full master weight from the same CPU generator
    # and keeps its piece, so the full weights do not depend on TP
    torch.manual_seed(1234)
    config = core_transformer_config_from_args(args)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(
                         num_experts=args.num_experts, moe_grouped_gemm=False, normalization="LayerNorm"),
                     vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                     pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=False, position_embedding_type="learned_absolute")
    if args.bf16:
        model.bfloat16()  # what Megatron's Float16Module does to the module it wraps (names unchanged)
    return model


def make_optimizer(args, model):
    import torch
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer
    from megatron.core.optimizer import _get_param_groups
    cfg = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=0.0)
    # Megatron's own grouping (no weight decay on biases and 1-D parameters) and its choice of
    # torch's AdamW when Apex/TransformerEngine's fused Adam is absent
    groups = _get_param_groups([model], cfg, None)
    adam = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay,
                             betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)

    def init_state_fn(opt, config=None):  # Megatron's own, for Adam (megatron/core/optimizer/__init__.py)
        for group in opt.param_groups:
            for p in group["params"]:
                if len(opt.state[p]) == 0:
                    opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)

    # FP32Optimizer keeps a 1.0 loss scale on 'cuda': made on the CPU here
    real_tensor = torch.tensor

    def cpu_tensor(*a, **k):
        if k.get("device") == "cuda":
            k["device"] = "cpu"
        return real_tensor(*a, **k)

    if args.bf16:
        # Megatron's mixed-precision optimizer: fp32 masters of the bf16 weights, no loss scaler
        # (what get_megatron_optimizer builds for --bf16 without the distributed optimizer)
        from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
        cfg.bf16, cfg.params_dtype = True, torch.bfloat16
        with on_cpu():
            return Float16OptimizerWithFloat16Params(adam, cfg, None, init_state_fn)
    torch.tensor = cpu_tensor
    try:
        opt = FP32Optimizer(adam, cfg, init_state_fn)
    finally:
        torch.tensor = real_tensor
    return opt


def main_param(q):
    """The parameter the optimizer steps for model parameter q: its fp32 master with the bf16
    wrapper (Float16OptimizerWithFloat16Params sets q.main_param), else q itself."""
    return getattr(q, "main_param", q)


def synthetic_grads(model, step):
    """Gradients drawn from a generator seeded by (parameter, step, TP rank for split parameters):
    replicated parameters get the same gradient on every TP rank, as an all-reduce would give."""
    import torch
    import zlib
    from megatron.core import mpu
    for n, p in model.named_parameters():
        split = getattr(p, "tensor_model_parallel", False)
        key = f"{n}|pp{mpu.get_pipeline_model_parallel_rank()}|{step}|"
        key += str(mpu.get_tensor_model_parallel_rank()) if split else "r"
        if not getattr(p, "allreduce", True):  # expert parameter: its own on each EP rank
            key += f"|ep{mpu.get_expert_model_parallel_rank()}"
        g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        p.grad = (torch.randn(p.shape, generator=g) * 0.1).to(p.dtype)  # bf16 weights: a bf16 gradient


def worker(case_name, outdir):
    import torch
    cpu_shims()
    case = CASES[case_name]
    tp, pp = case["tp"], case["pp"]
    world = int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group("gloo")
    ep = case["ep"]
    args = megatron_args(case, world, os.path.join(outdir, "torch_dist"), "torch_dist", tp, pp, ep)
    from megatron.training.global_vars import set_args
    from megatron.core import mpu
    set_args(args)
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    init_num_microbatches_calculator(args.rank, None, args.global_batch_size, args.micro_batch_size,
                                     args.data_parallel_size)
    model = build(args, tp, pp, ep)
    from megatron.training.checkpointing import save_checkpoint
    if case.get("distopt"):
        # Megatron's DDP (grad buffers) and DistributedOptimizer, as pretrain_gpt sets them up
        import torch
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        args.use_distributed_optimizer = True
        with on_cpu():
            ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
                use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                overlap_param_gather=False), model)
            ocfg = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=0.0,
                                   use_distributed_optimizer=True, params_dtype=torch.float32)
            opt = get_megatron_optimizer(ocfg, [ddp])
        for step in range(2):
            # the gradient every DP rank would have after the reduce-scatter: written whole
            synthetic_grads(model, step)
            for q in model.parameters():
                q.main_grad.copy_(q.grad)
                q.grad = None
            with on_cpu():
                opt.step()
        with on_cpu():
            save_checkpoint(2, [ddp], opt, None, 0)  # dp_reshardable
            args.dist_ckpt_optim_fully_reshardable = True
            args.save = os.path.join(outdir, "torch_dist_fully_reshardable")
            save_checkpoint(2, [ddp], opt, None, 0)
            args.dist_ckpt_optim_fully_reshardable = False
            args.ckpt_format = "torch"
            args.use_dist_ckpt = False
            args.save = os.path.join(outdir, "legacy")
            save_checkpoint(2, [ddp], opt, None, 0)
    else:
        opt = make_optimizer(args, model)
        with on_cpu() if case.get("bf16") else contextlib.nullcontext():
            for step in range(2):
                synthetic_grads(model, step)
                opt.step()
            # Megatron's own save, twice: torch_dist, then the legacy torch format
            save_checkpoint(2, [model], opt, None, 0)
            args.ckpt_format = "torch"
            args.use_dist_ckpt = False
            args.save = os.path.join(outdir, "legacy")
            save_checkpoint(2, [model], opt, None, 0)

    if SIZE:  # the bench needs the checkpoints only
        torch.distributed.barrier()
        return
    # what this rank holds
    import safetensors.torch as st
    t, p = mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank()
    e = mpu.get_expert_model_parallel_rank()
    sub = os.path.join(outdir, "expected", "local", f"tp{t}_pp{p}" + (f"_ep{e}" if ep > 1 else ""))
    if mpu.get_expert_data_parallel_rank() == 0:
        os.makedirs(sub, exist_ok=True)
        sd = {k: v for k, v in model.state_dict_for_save_checkpoint().items() if isinstance(v, torch.Tensor)}
        st.save_file({k: v.detach().clone().contiguous() for k, v in sd.items()},
                     os.path.join(sub, "model.safetensors"))
        if not case.get("distopt"):
            save_optimizer_state(opt, model, sub)
            # the legacy optimizer state numbers parameters in the order of the optimizer's groups
            name_of = {id(main_param(q)): n for n, q in model.named_parameters()}
            with open(os.path.join(sub, "optimizer_param_order.json"), "w") as f:
                json.dump([[name_of[id(q)] for q in g["params"]] for g in opt.optimizer.param_groups], f, indent=0)
    torch.distributed.barrier()


def save_optimizer_state(opt, model, sub):
    """Adam's exp_avg and exp_avg_sq of each model parameter (and with bf16 weights its fp32
    master, fp32.safetensors) under the parameter's name, into folder sub."""
    import safetensors.torch as st
    kinds = ("exp_avg", "exp_avg_sq") + (("fp32",) if hasattr(opt, "fp32_from_float16_groups") else ())
    for key in kinds:
        st.save_file({n: (main_param(q).detach() if key == "fp32" else opt.optimizer.state[main_param(q)][key])
                      .clone().contiguous() for n, q in model.named_parameters()}, os.path.join(sub, f"{key}.safetensors"))


def full_loader(case_name, outdir):
    """World 1, TP1 PP1: Megatron's dist_checkpointing.load of the torch_dist checkpoint."""
    import torch
    cpu_shims()
    case = CASES[case_name]
    torch.distributed.init_process_group("gloo")
    args = megatron_args(case, 1, os.path.join(outdir, "torch_dist"), "torch_dist", 1, 1)
    from megatron.training.global_vars import set_args
    set_args(args)
    model = build(args, 1, 1)
    opt = make_optimizer(args, model)
    from megatron.core import dist_checkpointing
    src = "torch_dist_fully_reshardable" if case.get("distopt") else "torch_dist"
    with open(os.path.join(outdir, src, "latest_checkpointed_iteration.txt")) as f:
        it = int(f.read().strip())
    ck = os.path.join(outdir, src, f"iter_{it:07d}")
    msd = model.sharded_state_dict()
    # the checkpoint's own key for each model tensor (Megatron's ShardedTensor.key: no layer
    # number, TE-style names for the local spec's layer norms) and the prepended (layer) axis
    keys = {}
    for n, sh in msd.items():
        keys[n] = {"type": type(sh).__name__, "key": getattr(sh, "key", None),
                   "prepend_axis_num": getattr(sh, "prepend_axis_num", None),
                   "global_offset": list(getattr(sh, "global_offset", []) or []),
                   "global_shape": list(getattr(sh, "global_shape", []) or [])}
    osd = opt.sharded_state_dict(msd, is_loading=True)
    # the saved param groups follow the saving run's grouping (with EP, expert parameters have
    # groups of their own); only the state tensors are taken, by the optimizer's parameter order
    osd.pop("param_groups", None)
    loaded = dist_checkpointing.load({"model": msd, "optimizer": osd}, ck)
    model.load_state_dict(loaded["model"], strict=False)
    # the optimizer's parameters in group order (with bf16 weights, their fp32 masters, loaded
    # from fp32_from_fp16_params: the bf16 wrapper nests the torch optimizer's state one deeper)
    order = [q for g in opt.optimizer.param_groups for q in g["params"]]
    wrapped = hasattr(opt, "fp32_from_float16_groups")
    inner = loaded["optimizer"]["optimizer"] if wrapped else loaded["optimizer"]
    for i, q in enumerate(order):
        for k in ("exp_avg", "exp_avg_sq"):
            opt.optimizer.state[q][k] = inner["state"][i][k]
    if wrapped:
        for mains, saved in zip(opt.fp32_from_float16_groups, loaded["optimizer"]["fp32_from_fp16_params"]):
            assert len(mains) == len(saved)
            for q, v in zip(mains, saved):
                q.data.copy_(v)
    import safetensors.torch as st
    sub = os.path.join(outdir, "expected", "full")
    os.makedirs(sub, exist_ok=True)
    sd = {k: v for k, v in model.state_dict_for_save_checkpoint().items() if isinstance(v, torch.Tensor)}
    st.save_file({k: v.detach().clone().contiguous() for k, v in sd.items()}, os.path.join(sub, "model.safetensors"))
    save_optimizer_state(opt, model, sub)
    with open(os.path.join(sub, "checkpoint_keys.json"), "w") as f:
        json.dump(keys, f, indent=1, sort_keys=True)
    # the groups of Megatron's own optimizer at TP1 PP1 (the resume below steps with them), by
    # module name: the distributed optimizer's checkpoints keep no params, so this is their record
    name_of = {id(main_param(q)): n for n, q in model.named_parameters()}
    with open(os.path.join(sub, "optimizer_param_order.json"), "w") as f:
        json.dump([[name_of[id(q)] for q in g["params"]] for g in opt.optimizer.param_groups], f, indent=0)
    common = dist_checkpointing.load_common_state_dict(ck)
    with open(os.path.join(sub, "common_keys.json"), "w") as f:
        json.dump(sorted(common.keys()), f)

    # Megatron's own resume of that state (world 1, TP1 PP1): each parameter's step is the one
    # saved (common.pt's common_step, or the distributed optimizer's per group), then step 3 with
    # the peer's gradients. What it stepped with and its state after the step: expected/resume/
    o = common["optimizer"]
    o = o["optimizer"] if "state" not in o and "state" in o.get("optimizer", {}) else o  # the bf16 wrapper's
    saved_step = float(o["state"]["common_step"]) if "state" in o else float(o["optimizer"]["param_groups"][0]["step"])
    for q in order:
        opt.optimizer.state[q]["step"] = torch.tensor(saved_step)
    names = {id(main_param(q)): n for n, q in model.named_parameters()}
    before = {names[id(q)]: (q.detach().clone(), opt.optimizer.state[q]["exp_avg"].clone(),
                             opt.optimizer.state[q]["exp_avg_sq"].clone()) for q in order}
    synthetic_grads(model, 2)
    # what the optimizer steps with: the gradient as its master's dtype (bf16 weights: the bf16
    # gradient widened, as Megatron's _copy_model_grads_to_main_grads does)
    grad = {n: q.grad.detach().float().contiguous() for n, q in model.named_parameters()}
    with on_cpu() if wrapped else contextlib.nullcontext():
        opt.step()
    after = {"fp32": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for n, q in model.named_parameters():
        after["fp32"][n] = main_param(q).detach().clone().contiguous()
        after["exp_avg"][n] = opt.optimizer.state[main_param(q)]["exp_avg"].clone().contiguous()
        after["exp_avg_sq"][n] = opt.optimizer.state[main_param(q)]["exp_avg_sq"].clone().contiguous()
    # the replay: torch's AdamW from the loaded state with those gradients gives Megatron's step
    group_of = {names[id(q)]: g for g in opt.optimizer.param_groups for q in g["params"]}
    differ = adamw_replay_differs(before, grad, after, saved_step, lambda n: {
        k: group_of[n][k] for k in ("lr", "betas", "eps", "weight_decay")})
    assert not differ, f"resume: torch's AdamW step differs from Megatron's in {differ}"
    write_resume(outdir, grad, after,
                 {"adam_step": saved_step + 1, "resumed_from": src, "world": "TP1 PP1 EP1",
                  "checked": "torch.optim.AdamW(foreach=False) stepped from the loaded state with grad == "
                             f"Megatron's {type(opt).__name__} step (bitwise)"})


def launch(mode, name, out, world, logroot):
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), USE_LIBUV="0", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                   CUDA_DEVICE_MAX_CONNECTIONS="1")
        log = open(os.path.join(logroot, f"{name}.{mode}.rank{r}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, __file__, mode, name, out], env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
    rcs = [p.wait(timeout=1200) for p in procs]
    if any(rcs):
        raise SystemExit(f"{name} {mode}: exited {rcs}; logs {logroot}/{name}.{mode}.rank*.log")


def run_case(name, root):
    import torch
    case = CASES[name]
    out = os.path.join(root, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    launch("--worker", name, out, case["tp"] * case["pp"] * case["ep"] * case.get("dp", 1), root)
    if SIZE:
        print(f"{name}: written (PEER_MCORE_SIZE={os.environ['PEER_MCORE_SIZE']})")
        return
    launch("--full", name, out, 1, root)
    meta = {"case": name, **case, "orig_vocab_size": ORIG_VOCAB, "megatron_commit": os.environ.get("PEER_MCORE_COMMIT", "?"),
            "torch_version": torch.__version__, "checks": []}
    try:
        from megatron.core.package_info import __version__ as v
        meta["megatron_core_version"] = v
    except Exception:
        pass
    meta["checks"] = verify(out, case)
    if os.path.exists(os.path.join(out, "expected", "resume", "step.json")):
        meta["checks"].append("resumed by Megatron (dist_checkpointing.load at TP1 PP1 EP1, the saved step): its step "
                              "3's gradient and state after it in expected/resume/, torch's AdamW replay of that step "
                              "== Megatron's (bitwise)")
    with open(os.path.join(out, "expected", "meta.json"), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
    print(f"{name}: ok: " + "; ".join(meta["checks"]))


def join_rule(name):
    """How Megatron-Core's GPT pieces join across TP ranks (what its sharded_state_dict declares):
    ('cat', dim), ('swiglu', 0): each rank holds [gate_r; up_r], the whole is [gate; up], or
    ('same', None): replicated."""
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias")):
        return ("cat", 0)
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        return ("swiglu", 0)
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return ("cat", 1)
    return ("same", None)


def global_name(local, pp_rank, layers_per_stage):
    import re
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)", local)
    if not m:
        return local
    return f"decoder.layers.{int(m.group(1)) + pp_rank * layers_per_stage}.{m.group(2)}"


def global_expert_name(name, ep_rank, local_experts):
    import re
    m = re.match(r"(.*\.local_experts\.)(\d+)(\..*)", name)
    if not m:
        return name
    return f"{m.group(1)}{int(m.group(2)) + ep_rank * local_experts}{m.group(3)}"


def rank_dir(t, p, e, case):
    return f"tp{t}_pp{p}" + (f"_ep{e}" if case["ep"] > 1 else "")


def legacy_dir(t, p, e, case):
    """megatron/training/checkpointing.py get_checkpoint_name"""
    d = f"mp_rank_{t:02d}"
    if case["pp"] > 1:
        d += f"_{p:03d}"
    if case["ep"] > 1:
        d += f"_{e:03d}"
    return d


def join(pieces_by_rank, case):
    """pieces_by_rank[(t, p, e)] = {local name: tensor} -> {global name: whole tensor}"""
    import torch
    tp, pp, ep = case["tp"], case["pp"], case["ep"]
    layers_per_stage = case["layers"] // pp
    local_experts = case["experts"] // ep if case["experts"] else 0
    out = {}
    for p in range(pp):
        for e in range(ep):
            for n in pieces_by_rank[(0, p, e)]:
                parts = [pieces_by_rank[(t, p, e)][n] for t in range(tp)]
                how, dim = join_rule(n)
                if how == "cat":
                    whole = torch.cat(parts, dim)
                elif how == "swiglu":
                    halves = [x.chunk(2, dim=0) for x in parts]
                    whole = torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
                else:
                    for x in parts[1:]:
                        assert torch.equal(x, parts[0]), f"replicated {n} differs across TP"
                    whole = parts[0]
                g = global_expert_name(global_name(n, p, layers_per_stage), e, local_experts)
                if g in out:  # a non-expert tensor: the same on every EP rank
                    assert torch.equal(out[g], whole), f"{g} differs across EP ranks"
                out[g] = whole
    return out


def verify(out, case):
    """The goldens against each other: the local pieces joined by the rules above equal what
    Megatron's own load gives at TP1 PP1 EP1; the legacy files hold exactly the local pieces
    (model and Adam state, the latter keyed by the parameter's index in the optimizer's groups)."""
    import torch
    import safetensors.torch as st
    tp, pp, ep = case["tp"], case["pp"], case["ep"]
    ranks = [(t, p, e) for t in range(tp) for p in range(pp) for e in range(ep)]
    checks = []
    ex = os.path.join(out, "expected")
    kinds = ("model",) if case.get("distopt") else ("model", "exp_avg", "exp_avg_sq")
    kinds += ("fp32",) if case.get("bf16") else ()
    for kind in kinds:
        pieces = {r: st.load_file(os.path.join(ex, "local", rank_dir(*r, case), f"{kind}.safetensors")) for r in ranks}
        whole = join(pieces, case)
        full = st.load_file(os.path.join(ex, "full", f"{kind}.safetensors"))
        assert set(whole) == set(full), (set(whole) ^ set(full))
        for n in full:
            assert torch.equal(whole[n], full[n]), f"{kind} {n}: joined pieces != Megatron's TP1 PP1 load"
    checks.append("local pieces (" + ", ".join(kinds) + ") joined by column/row/swiglu/replicated rules,"
                  " global layer numbers" + (" and global expert numbers" if ep > 1 else "") +
                  " == Megatron's dist_checkpointing.load at TP1 PP1 EP1 (bitwise)")
    with open(os.path.join(out, "legacy", "latest_checkpointed_iteration.txt")) as f:
        it = int(f.read())
    for r in ranks:
        sd = torch.load(os.path.join(out, "legacy", f"iter_{it:07d}", legacy_dir(*r, case), "model_optim_rng.pt"),
                        weights_only=False, map_location="cpu")
        local = st.load_file(os.path.join(ex, "local", rank_dir(*r, case), "model.safetensors"))
        for n, v in local.items():
            assert torch.equal(sd["model"][n], v), f"legacy {r} {n}"
        if case.get("distopt"):
            continue  # the optimizer is in distrib_optim.pt, in the DistributedOptimizer's buckets
        # the optimizer: torch's state_dict, parameters numbered in group order (bf16: inside
        # Float16OptimizerWithFloat16Params' dict, beside the fp32 masters of each group's bf16
        # parameters, in the group's order)
        osd = sd["optimizer"]["optimizer"] if case.get("bf16") else sd["optimizer"]
        order = [i for g in osd["param_groups"] for i in g["params"]]
        with open(os.path.join(ex, "local", rank_dir(*r, case), "optimizer_param_order.json")) as f:
            groups = json.load(f)
        names = [n for g in groups for n in g]
        assert len(order) == len(names)
        for kind in ("exp_avg", "exp_avg_sq"):
            want = st.load_file(os.path.join(ex, "local", rank_dir(*r, case), f"{kind}.safetensors"))
            for i, n in zip(order, names):
                assert torch.equal(osd["state"][i][kind], want[n]), f"legacy {r} {kind} {n}"
        if case.get("bf16"):
            want = st.load_file(os.path.join(ex, "local", rank_dir(*r, case), "fp32.safetensors"))
            masters = sd["optimizer"]["fp32_from_fp16_params"]
            assert [len(g) for g in masters] == [len(g) for g in groups]
            for g, ms in zip(groups, masters):
                for n, v in zip(g, ms):
                    assert v.dtype == torch.float32 and torch.equal(v, want[n]), f"legacy {r} fp32 {n}"
    pattern = "mp_rank_TT" + ("_PPP" if pp > 1 else "") + ("_EEE" if ep > 1 else "")
    checks.append("legacy " + pattern + ("/model_optim_rng.pt 'model' ==" if case.get("distopt") else
                                         "/model_optim_rng.pt 'model' and 'optimizer' state (by group order"
                                         + (", fp32_from_fp16_params" if case.get("bf16") else "") + ") ==")
                  + " the rank's local pieces (bitwise)")
    if case.get("distopt"):
        full = st.load_file(os.path.join(ex, "full", "exp_avg.safetensors"))
        assert all(t.abs().sum() > 0 for t in full.values()), "fully_reshardable exp_avg has zeros"
        checks.append("exp_avg/exp_avg_sq: Megatron's load of torch_dist_fully_reshardable at TP1 (no DP)")
    return checks


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "--full":
        full_loader(sys.argv[2], sys.argv[3])
    else:
        names = list(CASES) if sys.argv[1] == "all" else sys.argv[1].split(",")
        for n in names:
            run_case(n, sys.argv[2])
