"""The trainers' own offline converters against shardsafe on the same checkpoints, with the
physical limit, in one run: peak RSS and wall time side by side.

    /usr/bin/python3 bench/trainer_converters.py [TOOL] --ds-src DIR [--mlm-src DIR] [--quick]
                                                 [--reps N] [--dir DIR] [--keep] [--help]

TOOL is a built `shardsafe` (default build/tools/shardsafe); it runs here, on the host. The
trainers run from their source trees inside the Debian 13 root (scripts/env-debian13.sh, torch
2.6 CPU, Gloo), as tests/peers/make_goldens.sh runs them: --ds-src is a DeepSpeed tree (v0.19.5:
deepspeed/, accelerator/, op_builder/, version.txt), --mlm-src a Megatron-LM tree (core_v0.16.1:
megatron/, tools/, model_provider.py, gpt_builders.py; optional: without it the Megatron rows are left out). Both must lie under
/tmp or this checkout (what the root sees), e.g.
    git -C DeepSpeed archive v0.19.5 deepspeed accelerator op_builder version.txt | tar -x -C /tmp/ds
    git -C Megatron-LM archive core_v0.16.1 megatron tools model_provider.py gpt_builders.py | tar -x -C /tmp/mlm

The checkpoints are written by the trainers themselves, with the peers of tests/peers/ and their
opt-in size knobs: DeepSpeed (ds_peer.py, PEER_DS_SIZE: its tiny model with an embedding
[8192, 4096], 12 Linear(4096, 4096) blocks and two 4096 x 4096 linears, 268M parameters, 1 GiB in
F32; two Adam steps, DP 2 on Gloo) writes ZeRO-2 in fp32 and ZeRO-3 in bf16; Megatron-LM
(mcore_peer.py, PEER_MCORE_SIZE: its GPT with hidden 2048, FFN 5632 (SwiGLU), 4 layers, vocabulary
16384, 256M parameters, TP 2 x PP 2, two Adam steps, fp32) writes torch_dist and legacy.
--quick: 0.4M and 0.2M parameters. They go to DIR/shardsafe-trainer-ckpts-SIZE/ (--dir, default
/tmp, which must be /tmp or under it, or this checkout); --keep leaves them there and a later run
with --keep uses them again instead of writing them (their writing takes minutes).

Rows, each one command in a fresh process, the checkpoint in the page cache, outputs written to
the page cache under DIR; wall seconds (median of --reps, default 1) and the peak RSS from
os.wait4's ru_maxrss (the largest process of the command's tree; for the peers it includes the
interpreter, torch and the trainer: the `import deepspeed` / `import megatron` rows are that
alone; convert.py runs two processes, a loader and a saver, and the larger is counted):
- cat of the checkpoint's files > /dev/null: the read limit; dd of as many bytes as unshard's
  output to a file, into the page cache and with fdatasync: the write limits; "floor s" of a row
  is the read limit plus writing its output bytes at dd's page-cache rate (shardsafe's outputs
  are fdatasync'd, the peers' are not: a target holds shardsafe to the durable rate);
- DeepSpeed's zero_to_fp32 (convert_zero_checkpoint_to_fp32_state_dict to one model.safetensors;
  the script's CLI asks huggingface_hub to shard, which the root has not: max_shard_size=None)
  and ds_to_universal (--num_extract_workers 1 --num_merge_workers 1 --inject_missing_state);
- Megatron-LM's tools/checkpoint/convert.py (loader core, saver core: the legacy checkpoint to
  a legacy one at TP 1 PP 1, the model only), on the CPU with the peer's shims and five more
  (MCONV below says which and why); no converter runs on the torch_dist checkpoint here (the
  note printed with the table says why);
- shardsafe to-hf with the optimizer dropped (--rename '^optimizer\\..*$=', the tensors
  zero_to_fp32 and convert.py write), unshard, to-hf and to-dcp (model and optimizer: what
  ds_to_universal holds, in one file / folder).
The "x ss" columns divide a peer's wall time and peak RSS by those of the shardsafe row that
writes the same tensors (zero_to_fp32, convert.py: to-hf without optimizer; ds_to_universal:
unshard).
Checks (in the root, torch + safetensors): zero_to_fp32's tensors equal the live fp32 masters
(the peer's expected/fp32.safetensors) and shardsafe's, bit for bit; ds_to_universal's fp32,
exp_avg and exp_avg_sq equal shardsafe's unshard; convert.py's TP 1 model equals shardsafe's;
shardsafe's unshard, to-hf and to-dcp outputs hold the checkpoint's tensors (`shardsafe digest`).
Exit 1 when a check fails.
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, ".."))
ENV13 = os.path.join(REPO, "scripts", "env-debian13.sh")
FLAGS = {"--quick": 0, "--keep": 0, "--help": 0, "-h": 0, "--reps": 1, "--dir": 1, "--ds-src": 1, "--mlm-src": 1}
SIZES = {"full": "8192,4096,4096,4096,12", "quick": "512,256,256,256,2"}  # PEER_DS_SIZE: V,H,F,O,L
CASES = ("zero2_fp32", "zero3_bf16")


def parse(argv):
    """The flags (a word it does not know: exit 2 before anything runs)."""
    opts = {"tool": os.path.join(REPO, "build", "tools", "shardsafe"), "quick": False, "keep": False, "reps": 1,
            "dir": "/tmp", "ds_src": None, "mlm_src": None}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("--help", "-h"):
            print(__doc__)
            sys.exit(0)
        if a.startswith("-") and a not in FLAGS:
            sys.stderr.write(f"trainer_converters: unknown flag {a} (--help lists them)\n")
            sys.exit(2)
        if a in FLAGS and FLAGS[a]:
            if i + 1 >= len(argv):
                sys.stderr.write(f"trainer_converters: {a} needs a value\n")
                sys.exit(2)
            v = argv[i + 1]
            if a == "--reps":
                if not v.isdigit() or int(v) < 1:
                    sys.stderr.write("trainer_converters: --reps needs a positive number\n")
                    sys.exit(2)
                opts["reps"] = int(v)
            else:
                opts[a[2:].replace("-", "_")] = os.path.abspath(v)
            i += 2
            continue
        if a == "--quick":
            opts["quick"] = True
        elif a == "--keep":
            opts["keep"] = True
        elif i == 0 or not a.startswith("-"):
            opts["tool"] = os.path.abspath(a)
        i += 1
    if not os.access(opts["tool"], os.X_OK):
        sys.stderr.write(f"trainer_converters: {opts['tool']} is not an executable (build/tools/shardsafe)\n")
        sys.exit(2)
    seen = lambda p: p == "/tmp" or p.startswith("/tmp/") or p.startswith(REPO + "/")  # noqa: E731
    if not seen(opts["dir"]):
        sys.stderr.write(f"trainer_converters: --dir {opts['dir']}: the Debian 13 root sees /tmp and {REPO} only\n")
        sys.exit(2)
    for k, need in (("ds_src", "deepspeed/utils/zero_to_fp32.py"), ("mlm_src", "tools/checkpoint/convert.py"),
                    ("mlm_src", "model_provider.py")):
        p = opts[k]
        if p is None:
            continue
        if not seen(p) or not os.path.exists(os.path.join(p, need)):
            sys.stderr.write(f"trainer_converters: --{k.replace('_', '-')} {p}: no {need}, or not under /tmp or {REPO}\n")
            sys.exit(2)
    if opts["ds_src"] is None:
        sys.stderr.write("trainer_converters: --ds-src DIR (a DeepSpeed v0.19.5 source tree) is needed; --help\n")
        sys.exit(2)
    return opts


def ratio_target(name, r, ours, peer, what, fraction):
    """A target: shardsafe's row `ours` at most `fraction` of the peer's row `peer` in `what`
    ("peak RSS", index 1, MiB; "wall", index 0, s)."""
    i, unit, fmt = (1, "MiB", ".0f") if what == "peak RSS" else (0, "s", ".2f")
    return (f"{name}: {LABEL[ours]} {what} <= 1/{round(1 / fraction)} of {LABEL[peer]}'s", r[ours][i] <= r[peer][i] * fraction,
            f"{r[ours][i]:{fmt}} vs {r[peer][i]:{fmt}} {unit}")


LABEL = {"ss_model": "shardsafe to-hf (no optimizer)", "ss_unshard": "shardsafe unshard", "z2f": "zero_to_fp32",
         "uni": "ds_to_universal", "mconv": "Megatron convert.py"}


def compared(name, argv):
    """The checks a comparison script (COMPARE, MCOMPARE) run as argv reports on its last line:
    {what: [equal, compared, names that differ or are missing]}."""
    cmp = subprocess.run(argv, capture_output=True, text=True)
    if cmp.returncode != 0:
        sys.exit(f"trainer_converters: the comparison of {name} failed:\n{cmp.stderr[-3000:]}")
    return [(name, what, good == n and n > 0,
             f"{good}/{n} tensors equal" + (f" (differ or missing: {', '.join(bad)})" if bad else ""))
            for what, (good, n, bad) in json.loads(cmp.stdout.splitlines()[-1]).items()]


def in_root(args, cwd=None, env=()):
    """The command line that runs args inside the Debian 13 root (cwd: a folder the root sees)."""
    envs = [f"{k}={v}" for k, v in env]
    if cwd:
        return ["bash", ENV13, "run", "env"] + envs + ["bash", "-c", 'cd "$0" && exec "$@"', cwd] + args
    return ["bash", ENV13, "run", "env"] + envs + args


def wait_for(exe, limit=300):
    """A tool being relinked by a build is missing for a moment: wait for it (up to limit s)."""
    t = time.monotonic()
    while not os.access(exe, os.X_OK) and time.monotonic() - t < limit:
        time.sleep(2)


def measure(args, out=None, stdout=subprocess.DEVNULL):
    """Runs args alone: (wall seconds, peak RSS MiB of its largest process). Exits naming the
    command when it fails."""
    if os.path.isabs(args[0]):
        wait_for(args[0])
    if out:
        if os.path.isdir(out):
            shutil.rmtree(out)
        elif os.path.exists(out):
            os.unlink(out)
    t = time.perf_counter()
    p = subprocess.Popen(args, stdout=stdout, stderr=subprocess.PIPE)
    err = p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        sys.exit("trainer_converters: " + " ".join(args) + f" failed ({p.returncode}):\n" + err.decode()[-4000:])
    return wall, ru.ru_maxrss / 1024.0


def timed(args, reps, out=None):
    runs = [measure(args, out) for _ in range(reps)]
    return statistics.median(r[0] for r in runs), max(r[1] for r in runs)


def size_of(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def files_of(folder):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs)


def uptime():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def write_checkpoints(opts, root, size):
    """DeepSpeed writes the two cases (tests/peers/ds_peer.py with PEER_DS_SIZE); seconds taken."""
    t = time.perf_counter()
    subprocess.run(["bash", ENV13, "make", "peers"], check=True, stdout=subprocess.DEVNULL)
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    r = subprocess.run(["nice", "-n", "10"] + in_root(
        ["python3", os.path.join(REPO, "tests", "peers", "ds_peer.py"), ",".join(CASES), root], cwd=opts["ds_src"],
        env=(("PYTHONPATH", opts["ds_src"]), ("DS_ACCELERATOR", "cpu"), ("PEER_DS_SIZE", size))),
        capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"trainer_converters: ds_peer.py failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    for c in CASES:  # DeepSpeed's copy of its script, not part of the checkpoint
        z = os.path.join(root, c, "ckpt", "zero_to_fp32.py")
        if os.path.exists(z):
            os.unlink(z)
    with open(os.path.join(root, "done.json"), "w") as f:
        json.dump({"size": size}, f)
    return time.perf_counter() - t


ZERO_TO_FP32 = r"""
import sys
from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
convert_zero_checkpoint_to_fp32_state_dict(sys.argv[1], sys.argv[2], max_shard_size=None, safe_serialization=True)
"""

# the outputs against each other, in the root: prints one JSON object
COMPARE = r"""
import json, os, sys, torch
from safetensors import safe_open
z2f_path, live_path, ss_model_path, unshard_path, uni = sys.argv[1:6]
res = {}
def opened(p):
    return safe_open(p, framework="pt")
z2f, live, ssm, uns = opened(z2f_path), opened(live_path), opened(ss_model_path), opened(unshard_path)
def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
n = bad = 0; what = []
for k in live.keys():
    n += 1
    if not same(z2f.get_tensor(k), live.get_tensor(k)):
        bad += 1; what.append(k)
res["zero_to_fp32 == live fp32 masters"] = [n - bad, n, what[:3]]
uk = set(uns.keys()); n = bad = 0; what = []
for k in z2f.keys():
    n += 1
    m = f"optimizer.state.{k}.fp32" if f"optimizer.state.{k}.fp32" in uk else k
    a, b = z2f.get_tensor(k), uns.get_tensor(m)
    if b.dtype != a.dtype and m == k:  # a frozen parameter: zero_to_fp32 gives it in fp32
        b = b.float()
    if not same(a, b):
        bad += 1; what.append(k)
res["zero_to_fp32 == shardsafe unshard (fp32 masters; others as stored)"] = [n - bad, n, what[:3]]
n = bad = 0; what = []
mk = set(ssm.keys())
for k in z2f.keys():
    n += 1
    a = z2f.get_tensor(k)
    b = ssm.get_tensor(k) if k in mk else None
    if b is not None and b.dtype != a.dtype:
        b = b.float()
    if b is None or not same(a, b):
        bad += 1; what.append(k)
res["zero_to_fp32 == shardsafe to-hf without optimizer"] = [n - bad, n, what[:3]]
n = bad = 0; what = []
zd = os.path.join(uni, "zero")
for p in sorted(os.listdir(zd)):
    for kind in ("fp32", "exp_avg", "exp_avg_sq"):
        f = os.path.join(zd, p, kind + ".pt")
        if not os.path.exists(f):
            continue
        n += 1
        o = torch.load(f, weights_only=False, map_location="cpu")
        a = o["param"] if isinstance(o, dict) else o
        b = uns.get_tensor(f"optimizer.state.{p}.{kind}")
        if a.dim() == 1 and b.dim() != 1:
            a = a.view(b.shape)
        if not same(a, b):
            bad += 1; what.append(p + "/" + kind)
res["ds_to_universal == shardsafe unshard (fp32, exp_avg, exp_avg_sq)"] = [n - bad, n, what[:3]]
print(json.dumps(res))
"""


def largest_tensor(tool, ckpt):
    """(tensors, bytes of the largest) from `shardsafe inspect`."""
    wait_for(tool)
    r = subprocess.run([tool, "inspect", ckpt], check=True, capture_output=True, text=True)
    sizes = []
    for line in r.stdout.splitlines()[2:]:
        f = line.split()
        if len(f) >= 4 and f[1] != "-" and f[3].isdigit():
            sizes.append(int(f[3]))
    return len(sizes), max(sizes)


def digest(tool, path):
    """`shardsafe digest`, sorted, to-dcp's model./optim. keys named as unshard names them; or the
    error it ends with."""
    wait_for(tool)
    r = subprocess.run([tool, "digest", path], capture_output=True, text=True)
    if r.returncode != 0:
        return r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"
    out = []
    for line in r.stdout.splitlines():
        if not line or line.startswith("#"):
            continue
        if line.startswith("model."):
            line = line[len("model."):]
        elif line.startswith("optim."):
            line = "optimizer." + line[len("optim."):]
        out.append(line)
    return sorted(out)


def dd_write(path, nbytes, sync=False):
    return ["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={nbytes}", "iflag=count_bytes", "status=none"] + (
        ["conv=fdatasync"] if sync else [])


# Megatron-LM's tools/checkpoint/convert.py (loader core, saver core) run on the CPU, in the root:
# argv: MEGATRON_SRC REPO convert.py's arguments. What it needs there, each a change in this
# process only (Megatron's files are not touched), besides the peer's own CPU shims
# (tests/peers/mcore_peer.py: cpu_shims, on_cpu):
# - megatron.legacy.fused_kernels.load builds CUDA kernels with nvcc: made a no-op;
# - loader_core's import_model_provider returns model_provider without its builder (core_v0.16.1:
#   "TypeError: model_provider() missing 1 required positional argument: 'model_builder'"): the
#   bound one it keeps in self.model_provider is returned;
# - GPTModel asks parallel_state for its groups ("AssertionError: data parallel group is not
#   initialized"): a Gloo world of one is made in each of its two processes (loader, saver);
# - both build their argv without --no-persist-layer-norm, which the local layers need
#   ("persist_layer_norm not supported by torch LayerNorm"): added, with the other CPU flags;
# - the saver asserts transformer-engine >= 0.12 is installed ("PackageNotFoundError: No package
#   metadata was found for transformer-engine"), which the local implementation does not use:
#   the version check is skipped.
MCONV = r"""
import os, runpy, sys
mlm, repo = sys.argv[1], sys.argv[2]
sys.path[:0] = [os.path.join(repo, "tests", "peers"), mlm, os.path.join(mlm, "tools", "checkpoint")]
import mcore_peer
mcore_peer.cpu_shims()
import torch.distributed as dist
import megatron.legacy.fused_kernels as fk
fk.load = lambda *a, **k: None
import loader_base, loader_core, saver_base
imp = loader_core.MegatronCheckpointLoaderLLM.import_model_provider
def import_model_provider(self):
    r = imp(self)
    return getattr(self, "model_provider", None) or r
loader_core.MegatronCheckpointLoaderLLM.import_model_provider = import_model_provider
def world_of_one():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(mcore_peer.free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel()
for cls, m in ((loader_base.MegatronCheckpointLoaderBase, "load"), (saver_base.MegatronCheckpointSaverBase, "save")):
    def entry(self, _orig=getattr(cls, m)):
        world_of_one()
        return _orig(self)
    setattr(cls, m, entry)
for cls in (loader_base.MegatronCheckpointLoaderBase, saver_base.MegatronCheckpointSaverBase):
    def build_sys_argv(self, _orig=cls.build_sys_argv):
        return _orig(self) + ["--no-persist-layer-norm", "--no-gradient-accumulation-fusion", "--no-rope-fusion"]
    cls.build_sys_argv = build_sys_argv
def no_te_check(self):
    if self.args.megatron_path is not None:
        sys.path.insert(0, self.args.megatron_path)
saver_base.MegatronCheckpointSaverBase.insert_megatron_path_and_check_te = no_te_check
sys.argv = ["convert.py"] + sys.argv[3:]
with mcore_peer.on_cpu():
    runpy.run_path(os.path.join(mlm, "tools", "checkpoint", "convert.py"), run_name="__main__")
"""

# what the Megatron process imports before any work (the baseline of its peak RSS)
MIMPORT = r"""
import os, sys
sys.path[:0] = [os.path.join(sys.argv[2], "tests", "peers"), sys.argv[1]]
import mcore_peer
mcore_peer.cpu_shims()
import megatron.training.checkpointing, megatron.core.models.gpt
"""

# convert.py's TP1 PP1 model against shardsafe's tensors of the same names
MCOMPARE = r"""
import json, sys, torch
from safetensors import safe_open
sd = torch.load(sys.argv[1], weights_only=False, map_location="cpu")["model"]
ss = safe_open(sys.argv[2], framework="pt")
keys = set(ss.keys())
n = bad = 0; what = []
for k, v in sd.items():
    if not isinstance(v, torch.Tensor):
        continue
    n += 1
    b = ss.get_tensor(k) if k in keys else None
    if b is None or not (v.dtype == b.dtype and v.shape == b.shape and torch.equal(v, b)):
        bad += 1; what.append(k)
print(json.dumps({"Megatron convert.py (TP1 PP1) == shardsafe to-hf without optimizer": [n - bad, n, what[:3]]}))
"""

MEGATRON_SIZES = {"full": "2048,5632,4,16384", "quick": "64,96,4,128"}  # PEER_MCORE_SIZE: hidden, ffn, layers, vocab
MCASE = "mcore_gpt_tp2_pp2"


def write_megatron(opts, root, size):
    r = subprocess.run(["nice", "-n", "10"] + in_root(
        ["python3", os.path.join(REPO, "tests", "peers", "mcore_peer.py"), MCASE, root],
        env=(("PYTHONPATH", opts["mlm_src"]), ("PEER_MCORE_SIZE", size))), capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"trainer_converters: mcore_peer.py failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


class Case:
    """The rows of one checkpoint: limits, the peers given, shardsafe's commands."""

    def __init__(self, name, ckpt, data, base, tool, reps):
        self.name, self.ckpt, self.data, self.base, self.tool, self.reps = name, ckpt, data, base, tool, reps
        self.r, self.ref = {}, {}

    def o(self, n):
        return os.path.join(self.base, n)

    def run(self, key, args, label, kind, out=None):
        wall, peak = timed(args, self.reps, self.o(out) if out else None)
        self.r[key] = (wall, peak, size_of(self.o(out)) if out else 0, kind, label)

    def shardsafe(self):
        t, c = self.tool, self.ckpt
        self.run("ss_model", [t, "to-hf", c, self.o("ss-model"), "--rename", r"^optimizer\..*$="],
                 "shardsafe to-hf, optimizer dropped", "shardsafe", "ss-model")
        self.run("ss_unshard", [t, "unshard", c, self.o("unshard.safetensors")],
                 "shardsafe unshard (model + optimizer)", "shardsafe", "unshard.safetensors")
        self.run("ss_hf", [t, "to-hf", c, self.o("ss-hf")], "shardsafe to-hf (model + optimizer)", "shardsafe", "ss-hf")
        self.run("ss_dcp", [t, "to-dcp", c, self.o("ss-dcp")], "shardsafe to-dcp (model + optimizer)", "shardsafe",
                 "ss-dcp")

    def limits(self):
        cat = ["bash", "-c", 'cat "$@" > /dev/null', "cat"] + files_of(self.data)
        measure(cat)  # the page cache warm
        self.r["read"] = timed(cat, self.reps) + (0, "limit", "cat checkpoint files > /dev/null")
        big = self.r["ss_unshard"][2]
        self.r["write"] = timed(dd_write(self.o("dd.bin"), big), self.reps, self.o("dd.bin")) + (
            big, "limit", "dd write of unshard's bytes")
        self.r["write_sync"] = timed(dd_write(self.o("dd.bin"), big, True), self.reps, self.o("dd.bin")) + (
            big, "limit", "dd write + fdatasync of unshard's bytes")
        os.unlink(self.o("dd.bin"))

    def durable_floor(self, key):
        """Reading the checkpoint and writing key's output bytes durably (shardsafe fdatasyncs)."""
        return self.r["read"][0] + self.r[key][2] / (self.r["write_sync"][2] / self.r["write_sync"][0])

    def digests_agree(self):
        """shardsafe's outputs against the checkpoint, tensor by tensor (`shardsafe digest`)."""
        d = digest(self.tool, self.ckpt)
        out = []
        for what, n in (("unshard", "unshard.safetensors"), ("to-hf", "ss-hf"), ("to-dcp", "ss-dcp")):
            g = digest(self.tool, self.o(n))
            if isinstance(g, str):
                out.append((self.name, f"shardsafe {what} output == the checkpoint (digest)", False,
                            f"digest of the output fails: {g[:400]}"))
            else:
                out.append((self.name, f"shardsafe {what} output == the checkpoint (digest)", g == d,
                            f"{len(d)} tensors" if g == d else f"{len(set(g) ^ set(d))} lines differ"))
        return out

    def clean(self):
        for n in os.listdir(self.base):
            p = self.o(n)
            shutil.rmtree(p) if os.path.isdir(p) else os.unlink(p)

    def rows(self, order):
        write_rate = self.r["write"][2] / self.r["write"][0]
        out = []
        for k in order:
            if k not in self.r:
                continue
            wall, peak, nbytes, kind, label = self.r[k]
            floor = self.r["read"][0] + nbytes / write_rate if kind != "limit" and nbytes else None
            rr = self.r.get(self.ref.get(k))
            out.append(dict(case=self.name, label=label, kind=kind, wall=wall, peak=peak, out=nbytes, floor=floor,
                            xt=wall / rr[0] if rr else None, xm=peak / rr[1] if rr else None))
        return out


def main(argv):
    opts = parse(argv)
    tool, reps = opts["tool"], opts["reps"]
    tag = "quick" if opts["quick"] else "full"
    size, msize = SIZES[tag], MEGATRON_SIZES[tag]
    with_mlm = opts["mlm_src"] is not None
    t0 = time.perf_counter()
    print(f"# trainer_converters: {tag} (PEER_DS_SIZE={size}" + (f", PEER_MCORE_SIZE={msize}" if with_mlm else "") +
          f"), {reps} round(s), page cache; tool {tool}")
    print(f"# load average before: {uptime()}")
    root = os.path.join(opts["dir"], f"shardsafe-trainer-ckpts-{tag}")
    done = os.path.join(root, "done.json")
    want = {"size": size, "megatron": msize if with_mlm else None}
    if opts["keep"] and os.path.exists(done) and json.load(open(done)) == want:
        print(f"# checkpoints: {root} (kept from an earlier run with --keep)")
    else:
        secs = write_checkpoints(opts, root, size)
        print(f"# checkpoints: DeepSpeed (ds_peer.py, DP 2, 2 Adam steps) wrote {', '.join(CASES)} in {secs:.0f} s")
        if with_mlm:
            t = time.perf_counter()
            write_megatron(opts, root, msize)
            print(f"# checkpoints: Megatron-LM (mcore_peer.py, TP 2 x PP 2, 2 Adam steps) wrote {MCASE} torch_dist "
                  f"and legacy in {time.perf_counter() - t:.0f} s")
        with open(done, "w") as f:
            json.dump(want, f)
    print(f"# checkpoints under {root}")
    base = tempfile.mkdtemp(prefix="shardsafe-bench-trainers-", dir=opts["dir"])
    ds_env = (("PYTHONPATH", opts["ds_src"]), ("DS_ACCELERATOR", "cpu"))
    rows, checks, targets, notes = [], [], [], []
    order = ("read", "write", "write_sync", "import", "z2f", "mconv", "ss_model", "uni", "ss_unshard", "ss_hf", "ss_dcp")

    def describe(c):
        ntensors, biggest = largest_tensor(tool, c.ckpt)
        print(f"# {c.name}: checkpoint {size_of(c.data)} bytes in {len(files_of(c.data))} files; {ntensors} tensors, "
              f"the largest {biggest} bytes ({biggest / 2**20:.1f} MiB)")
        return biggest / 2**20

    def bound(c, mib):
        ks = ("ss_model", "ss_unshard", "ss_hf", "ss_dcp")
        out = [(f"{c.name}: every shardsafe row's peak RSS <= 2 x the largest tensor ({mib:.1f} MiB) + 64 MiB",
                all(c.r[k][1] <= 2 * mib + 64 for k in ks), ", ".join(f"{c.r[k][1]:.0f}" for k in ks) + " MiB")]
        for k, what in (("ss_hf", "to-hf"), ("ss_unshard", "unshard")):
            f = c.durable_floor(k)
            out.append((f"{c.name}: shardsafe {what} (model + optimizer) wall <= 2 x reading the checkpoint + "
                        f"writing its output with fdatasync", c.r[k][0] <= 2 * f, f"{c.r[k][0]:.2f} s; that floor {f:.2f} s"))
        return out

    try:
        for case in CASES:
            ckpt = os.path.join(root, case, "ckpt")
            c = Case(case, ckpt, os.path.join(ckpt, "global_step2"), base, tool, reps)
            mib = describe(c)
            c.run("import", in_root(["python3", "-c", "import deepspeed"], cwd=opts["ds_src"], env=ds_env),
                  "python3: import deepspeed (no work)", "peer")
            c.run("z2f", in_root(["python3", "-c", ZERO_TO_FP32, ckpt, c.o("z2f")], cwd=opts["ds_src"], env=ds_env),
                  "DeepSpeed zero_to_fp32 -> safetensors", "peer", "z2f")
            c.run("uni", in_root(["python3", "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", c.data,
                                  "--output_folder", c.o("uni"), "--num_extract_workers", "1",
                                  "--num_merge_workers", "1", "--inject_missing_state"], cwd=opts["ds_src"],
                                 env=ds_env), "DeepSpeed ds_to_universal", "peer", "uni")
            c.shardsafe()
            c.limits()
            c.ref = {"z2f": "ss_model", "uni": "ss_unshard"}
            checks += compared(case, in_root(["python3", "-c", COMPARE, os.path.join(c.o("z2f"), "model.safetensors"),
                                              os.path.join(root, case, "expected", "fp32.safetensors"),
                                              os.path.join(c.o("ss-model"), "model.safetensors"),
                                              c.o("unshard.safetensors"), c.o("uni")]))
            checks += c.digests_agree()
            c.clean()
            rows += c.rows(order)
            r = c.r
            targets += [
                ratio_target(case, r, "ss_model", "z2f", "peak RSS", 1 / 10),
                ratio_target(case, r, "ss_unshard", "uni", "peak RSS", 1 / 10),
                ratio_target(case, r, "ss_model", "z2f", "wall", 1 / 4),
                ratio_target(case, r, "ss_unshard", "uni", "wall", 1 / 2),
            ] + bound(c, mib)
        if with_mlm:
            mroot = os.path.join(root, MCASE)
            for fmt in ("legacy", "torch_dist"):
                ckpt = os.path.join(mroot, fmt)
                c = Case(f"mcore {fmt}", ckpt, os.path.join(ckpt, "iter_0000002"), base, tool, reps)
                mib = describe(c)
                if fmt == "legacy":
                    c.run("import", in_root(["python3", "-c", MIMPORT, opts["mlm_src"], REPO],
                                            env=(("PYTHONPATH", opts["mlm_src"]),)),
                          "python3: import megatron (no work)", "peer")
                    c.run("mconv", in_root(["python3", "-c", MCONV, opts["mlm_src"], REPO, "--model-type", "GPT",
                                            "--loader", "core", "--saver", "core", "--load-dir", ckpt,
                                            "--save-dir", c.o("mconv"), "--target-tensor-parallel-size", "1",
                                            "--target-pipeline-parallel-size", "1",
                                            "--loader-transformer-impl", "local", "--saver-transformer-impl",
                                            "local"], env=(("PYTHONPATH", opts["mlm_src"]),
                                                           ("CUDA_DEVICE_MAX_CONNECTIONS", "1"))),
                          "Megatron convert.py -> legacy TP1 PP1 (model)", "peer", "mconv")
                c.shardsafe()
                c.limits()
                c.ref = {"mconv": "ss_model"}
                if fmt == "legacy":
                    checks += compared(c.name, in_root(["python3", "-c", MCOMPARE,
                                                         os.path.join(c.o("mconv"), "iter_0000002", "mp_rank_00",
                                                                      "model_optim_rng.pt"),
                                                         os.path.join(c.o("ss-model"), "model.safetensors")],
                                                        env=(("PYTHONPATH", opts["mlm_src"]),)))
                    r = c.r
                    targets += [ratio_target(c.name, r, "ss_model", "mconv", "peak RSS", 1 / 10),
                                ratio_target(c.name, r, "ss_model", "mconv", "wall", 1 / 4)]
                else:
                    notes.append("mcore torch_dist: no trainer converter runs on it here: Megatron's convert.py "
                                 "(loader core) loads one TP rank at a time in a world of one, and "
                                 "dist_checkpointing.load refuses that: \"CheckpointingException: Invalid access "
                                 "pattern for ShardedTensor(key='embedding.word_embeddings.weight', ...)\"; torch's "
                                 "dcp_to_torch_save stops on Megatron's metadata: \"TypeError: argument of type "
                                 "'NoneType' is not iterable\" (default_planner.py, metadata.planner_data)")
                checks += c.digests_agree()
                targets += bound(c, mib)
                c.clean()
                rows += c.rows(order)
        print()
        print(f"| {'case':<16} | {'tool':<45} | {'wall s':>7} | {'peak RSS MiB':>12} | {'wall x ss':>9} | "
              f"{'RSS x ss':>8} | {'output bytes':>13} | {'floor s':>7} |")
        print(f"|{'-' * 18}|{'-' * 47}|{'-' * 9}|{'-' * 14}|{'-' * 11}|{'-' * 10}|{'-' * 15}|{'-' * 9}|")
        for w in rows:
            fmt = lambda v, f: (f % v) if v is not None else "-"  # noqa: E731
            print(f"| {w['case']:<16} | {w['label']:<45} | {w['wall']:7.2f} | {w['peak']:12.0f} | "
                  f"{fmt(w['xt'], '%8.2fx'):>9} | {fmt(w['xm'], '%7.2fx'):>8} | {w['out'] or '-':>13} | "
                  f"{fmt(w['floor'], '%7.2f'):>7} |")
        print()
        for n in notes:
            print("note: " + n)
        print("checks:")
        for case, what, ok, detail in checks:
            print(f"  {'agree' if ok else 'DISAGREE'}: {case}: {what}: {detail}")
        print("targets:")
        for what, ok, detail in targets:
            print(f"  {'met' if ok else 'MISSED'}: {what} ({detail})")
        print(f"# load average after: {uptime()}; the run took {time.perf_counter() - t0:.0f} s")
        if not all(c[2] for c in checks):
            sys.exit(1)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        if not opts["keep"]:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
