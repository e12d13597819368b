"""What the trainer-golden checks (deepspeed_layout_check.py, megatron_layout_check.py) share:
safetensors files read with struct and json (no torch), the tool run, and the tensors shardsafe
wrote compared with the trainer's, name by name and bit for bit."""
import json
import struct
import subprocess


def read_safetensors(path):
    """{name: (dtype, shape, bytes)} of a safetensors file."""
    with open(path, "rb") as f:
        b = f.read()
    (n,) = struct.unpack("<Q", b[:8])
    h = json.loads(b[8:8 + n])
    data = b[8 + n:]
    return {k: (v["dtype"], tuple(v["shape"]), data[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in h.items() if k != "__metadata__"}


def run(tool, *args, rc=0):
    """`tool args...`, which must exit rc; its stderr."""
    p = subprocess.run([tool, *args], capture_output=True, text=True)
    if p.returncode != rc:
        raise SystemExit(f"FAILED: shardsafe {' '.join(args)} exited {p.returncode} (not {rc}): {p.stderr.strip()}")
    return p.stderr


def compare(path, got, want, whose):
    """got (what shardsafe wrote) holds exactly want's names, each bit for bit `whose` tensor."""
    if set(got) != set(want):
        raise SystemExit(f"FAILED {path}: names differ: only shardsafe {sorted(set(got) - set(want))[:8]}, "
                         f"only expected {sorted(set(want) - set(got))[:8]}")
    for name, t in want.items():
        if got[name] != t:
            raise SystemExit(f"FAILED {path}: tensor '{name}': shardsafe {got[name][:2]} differs from {whose} "
                             f"{t[:2]}" + (" (values)" if got[name][:2] == t[:2] else ""))


def golden_cases(argv, prefix, trainer):
    """(tool, the goldens' folder, the case folders whose names start with prefix) from
    argv: TOOL [PEERS_DIR]."""
    import os
    tool = argv[1]
    root = argv[2] if len(argv) > 2 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures",
                                                      "peers")
    cases = sorted(c for c in os.listdir(root) if c.startswith(prefix) and os.path.isdir(os.path.join(root, c)))
    if not cases:
        raise SystemExit(f"no {trainer} goldens in {root}")
    return tool, root, cases


def unshard(tool, path, tmp):
    """The tensors `shardsafe unshard path` writes, read back."""
    import os
    out = os.path.join(tmp, "all.safetensors")
    if os.path.exists(out):
        os.remove(out)
    run(tool, "unshard", path, out)
    return read_safetensors(out)
