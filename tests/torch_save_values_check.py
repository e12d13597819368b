"""The tool against torch on torch.save files that torch.load reads and shardsafe refused before
(issue 53, round three): a training checkpoint's bytes, bytearray, set and frozenset values and
values nested 999 deep; a non-dense view (a column slice of a fused weight) beside other tensors.

    /usr/bin/python3 tests/torch_save_values_check.py TOOL [--dcp2]

Run with the torch of /usr/bin/python3 (1.13; 2.6 in the Debian 13 root), which writes every file
(torch.save: zip, legacy and protocol 4) and reads it back (torch.load, weights_only=False) as the
reference:
  - values: `inspect` lists each as repr() writes it (cut to 60 characters); `to-dcp` writes
    them, and each DCP item's data.pkl, loaded by Python's pickle, is the value torch.load gave
    (type and value), and is the bytes of pickle.dumps(value, 2) less its memo PUTs
    (pickletools.optimize) where Python writes one of each global;
  - the view: `inspect` lists every tensor, the view as not read; `digest` of the file refuses
    naming it; `to-hf --rename '^a$='` exports the other tensors bit for bit as torch gives them.
With --dcp2 (the Debian 13 root's torch 2.6, through scripts/env-debian13.sh): each file but its
999-deep value (torch's dcp.save recurses through nested lists and fails there) is also written
by to-dcp and compared with torch's own dcp.save of torch.load(file) (tests/dcp2_tool_check.py
train_values). Prints what it checked and exits 0, or names what differs and exits 1.
"""
import functools
import io
import json
import os
import pickle
import pickletools
import struct
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
try:
    import torch_compat  # noqa: E402,F401  (torch 1.13 on Python 3.11)
    import torch  # noqa: E402
except ImportError:
    print("no torch in " + sys.executable + ": skipped")
    sys.exit(77)  # meson's code for a skipped test

sys.setrecursionlimit(20000)
TOOL = sys.argv[1]
BAD = []


def tool(*args):
    r = subprocess.run([TOOL] + list(args), capture_output=True)
    return r.returncode, r.stdout.decode("utf-8", "replace"), r.stderr.decode("utf-8", "replace")


def values():
    deep = functools.reduce(lambda a, _: [a], range(998), [])  # 999 lists, each inside the one before
    return {"model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)},
            "blob": b"ab\xff\x00'\x80", "empty": b"", "buf": bytearray(b"x\x80"), "ebuf": bytearray(),
            "ids": {3, 1, 2}, "none": set(), "frozen": frozenset({"a"}), "pairs": frozenset({(1, 2)}),
            "mixed": (b"k", frozenset({1.5}), {7}), "deep": deep, "epoch": 3}


def item_pickles(folder):
    """Every bytes item's data.pkl of the tool's DCP folder, by key, read without
    torch.distributed.checkpoint (torch 1.13 has none): the .metadata pickle's classes stand in."""
    class Stub:
        def __init__(self, *a, **k):
            self.args = a
            self.__dict__.update(k)

        def __setstate__(self, state):
            for part in (state if isinstance(state, tuple) else (state,)):
                if isinstance(part, dict):
                    self.__dict__.update(part)

    class Reader(pickle.Unpickler):
        def find_class(self, module, name):
            if module.startswith("torch.distributed.checkpoint"):
                return type(name, (Stub,), {})
            return super().find_class(module, name)

    with open(os.path.join(folder, ".metadata"), "rb") as f:
        md = Reader(f).load()
    out = {}
    for idx, info in md.storage_data.items():
        if type(md.state_dict_metadata[idx.fqn]).__name__ != "BytesStorageMetadata":
            continue
        with open(os.path.join(folder, info.relative_path), "rb") as f:
            f.seek(info.offset)
            z = zipfile.ZipFile(io.BytesIO(f.read(info.length)))
        out[idx.fqn] = z.read([n for n in z.namelist() if n.endswith("/data.pkl")][0])
    return out


def one_global_each(v, seen=None):
    """Whether pickling v (protocol 2) names each global once (Python then writes no BINGET)."""
    names = []

    def walk(x):
        if isinstance(x, (bytes, bytearray)):
            names.extend(["bytearray"] * isinstance(x, bytearray) + ["encode" if x else "bytes"])
        elif isinstance(x, (set, frozenset)):
            names.append(type(x).__name__)
            for y in x:
                walk(y)
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for k, y in x.items():
                walk(k)
                walk(y)
    walk(v)
    return len(names) == len(set(names))


def check_values(tmp, dcp2):
    sd = values()
    identical = compared = 0
    for name, kw in (("zip", {}), ("legacy", {"_use_new_zipfile_serialization": False}), ("proto4", {"pickle_protocol": 4})):
        pt = os.path.join(tmp, name + ".pt")
        torch.save(sd, pt, **kw)
        back = torch.load(pt, weights_only=False)
        code, out, err = tool("inspect", pt)
        if code != 0:
            BAD.append(f"{name}: inspect exited {code}: {err}")
            continue
        rows = {line.split(" ", 1)[0]: line for line in out.split("\n") if line}
        for key, v in back.items():
            if key == "model":
                continue
            r = repr(v) if not isinstance(v, (set, frozenset)) or len(v) < 2 else None  # a set's order is its hashes'
            if key not in rows:
                BAD.append(f"{name}: inspect lists no '{key}'")
            elif r is not None and not rows[key].endswith("value: " + (r if len(r) <= 60 else r[:57] + "...")):
                BAD.append(f"{name}: inspect's row of '{key}' is {rows[key]!r}, not repr() {r[:60]!r}")
        dcp = os.path.join(tmp, name + "-dcp")
        code, out, err = tool("to-dcp", pt, dcp)
        if code != 0:
            BAD.append(f"{name}: to-dcp exited {code}: {err}")
            continue
        items = item_pickles(dcp)
        for key, v in back.items():
            if key == "model":
                continue
            got = pickle.loads(items[key]) if key in items else None
            if type(got) is not type(v) or got != v:
                BAD.append(f"{name}: to-dcp's item '{key}' loads as {got!r:.80}, torch.load gave {v!r:.80}")
            if one_global_each(v):
                compared += 1
                identical += items.get(key) == pickletools.optimize(pickle.dumps(v, protocol=2))
        if dcp2:  # torch's own dcp.save walks a list recursively: 999 levels pass its recursion limit
            pt, dcp = os.path.join(tmp, name + "-shallow.pt"), os.path.join(tmp, name + "-shallow-dcp")
            torch.save({k: v for k, v in sd.items() if k != "deep"}, pt, **kw)
            code, out, err = tool("to-dcp", pt, dcp)
            if code != 0:
                BAD.append(f"{name}: to-dcp of the file without 'deep' exited {code}: {err}")
            r = subprocess.run([os.path.join(os.path.dirname(HERE), "scripts", "env-debian13.sh"), "run", "python3",
                                os.path.join(HERE, "dcp2_tool_check.py"), "train_values", pt, dcp],
                               capture_output=True, text=True)
            print(f"{name}: torch 2.6's dcp.save of torch.load: {r.stdout.strip()} {r.stderr.strip()[-300:]}")
            if r.returncode != 0:
                BAD.append(f"{name}: against torch 2.6's dcp.save: {r.stdout} {r.stderr[-600:]}")
    print(f"values: 3 files, {len(sd) - 1} values each; to-dcp's items {identical} of {compared} byte-identical "
          f"to pickle.dumps(v, 2) less memo PUTs (values naming each global once)")


def check_view(tmp):
    torch.manual_seed(3)
    fused = torch.randn(6, 12)
    other = torch.randn(5, 2).to(torch.bfloat16)
    sd = {"a": fused[:, :4], "b": other, "c": fused[:, 4:].contiguous()}
    for name, kw in (("view", {}), ("view_legacy", {"_use_new_zipfile_serialization": False})):
        pt = os.path.join(tmp, name + ".pt")
        torch.save(sd, pt, **kw)
        back = torch.load(pt, weights_only=True)
        if back["a"].stride() != (12, 1) or not torch.equal(back["a"], fused[:, :4]):
            BAD.append(f"{name}: torch did not keep the view's stride")
        code, out, err = tool("inspect", pt)
        if code != 0 or "1 tensor(s) not read" not in out or "stride [12,1] is not dense for size [6,4]" not in out:
            BAD.append(f"{name}: inspect: {code} {out!r} {err!r}")
        code, out, err = tool("digest", pt)
        if code != 1 or "tensor 'a' [6,4]" not in err or "not dense" not in err:
            BAD.append(f"{name}: digest of the file: {code} {err!r}")
        hf = os.path.join(tmp, name + "-hf")
        code, out, err = tool("to-hf", pt, hf, "--rename", "^a$=")
        if code != 0:
            BAD.append(f"{name}: to-hf without the view: {err}")
            continue
        st = open(os.path.join(hf, "model.safetensors"), "rb").read()
        n = struct.unpack_from("<Q", st)[0]
        h = json.loads(st[8:8 + n])
        for key in ("b", "c"):
            t = back[key].contiguous().reshape(-1)
            want = t.view(torch.int16 if t.dtype == torch.bfloat16 else t.dtype).numpy().tobytes()
            b0, b1 = h[key]["data_offsets"]
            if st[8 + n + b0:8 + n + b1] != want:
                BAD.append(f"{name}: to-hf's '{key}' differs from torch's")
        if "a" in h:
            BAD.append(f"{name}: to-hf wrote the view")
    print("view: 2 files (zip, legacy), the view listed and refused by name, 'b' and 'c' bit for bit as torch gives them")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        check_values(tmp, "--dcp2" in sys.argv)
        check_view(tmp)
    if BAD:
        print("\n".join(BAD))
        sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()
