"""One rule set for every command (issue 53): what `verify` refuses, every command that reads
the same bytes refuses (an optimizer's pickles, the checksums a checkpoint records); an export
that would write nothing, or leave out a tensor it cannot name, is refused naming why.

Loaded by hostile.py (load_case_files) with its helpers in scope: run, case, Failed, write,
safetensors_bytes, sharded_checkpoint, torch_save_bytes, torch_zip_of, pickled_tensor.
"""
import ctypes
import json
import os
import pickle
import shutil
import struct

# The pickles an optim/ folder's param_group{i} or state_keys may hold that run code: each names
# something outside the plain-data reader's allowlist (a GLOBAL, a STACK_GLOBAL, INST, OBJ,
# NEWOBJ, a REDUCE of one), as an attacker's checkpoint would.
_GOOD_GROUP = b"\x80\x02}(X\x0c\x00\x00\x00_param_names](X\x01\x00\x00\x00wX\x01\x00\x00\x00beu."


def _su(s):  # SHORT_BINUNICODE
    return b"\x8c" + bytes([len(s)]) + s


class _System:
    def __reduce__(self):
        return (os.system, ("true",))


def _evil_pickles():
    """name -> (param groups, state_keys or None): 11 ways to name os.system (or another callable)."""
    true = b"X\x04\x00\x00\x00true"
    return {
        "global": ([b"\x80\x02cposix\nsystem\n" + true + b"\x85R."], None),
        "global_os": ([b"\x80\x02cos\nsystem\n" + true + b"\x85R."], None),
        "stack_global": ([b"\x80\x04" + _su(b"os") + _su(b"system") + b"\x93" + _su(b"true") + b"\x85R."], None),
        "python_pickler": ([pickle.dumps(_System(), protocol=4)], None),
        "inst": ([b"\x80\x02(" + true + b"ios\nsystem\n."], None),
        "obj": ([b"\x80\x02(cos\nsystem\n" + true + b"o."], None),
        "newobj": ([b"\x80\x02cos\nsystem\n)\x81."], None),
        "builtins_eval": ([b"\x80\x02cbuiltins\neval\nX\x04\x00\x00\x00None\x85R."], None),
        # inside the group dict, as the value of a hyper-parameter
        "nested_value": ([b"\x80\x02}(X\x0c\x00\x00\x00_param_names](X\x01\x00\x00\x00wX\x01\x00\x00\x00beX\x02\x00\x00"
                          b"\x00lrcos\nsystem\n" + true + b"\x85Ru."], None),
        "second_group": ([_GOOD_GROUP, b"\x80\x02cos\nsystem\n" + true + b"\x85R."], None),
        "state_keys": ([_GOOD_GROUP], b"\x80\x02]cos\nsystem\n" + true + b"\x85Ra."),
    }


def _optim(d, groups, state_keys=None):
    """An optim/ folder of the optimizer layout (docs/FORMAT.md §2): num_param_groups, the groups'
    pickles, state_keys where given, one state tensor."""
    ts = [("num_param_groups", "I64", [], struct.pack("<q", len(groups)))]
    for i, g in enumerate(groups):
        ts.append((f"param_group{i}", "U8", [len(g)], g))
    if state_keys is not None:
        ts.append(("state_keys", "U8", [len(state_keys)], state_keys))
    ts.append(("state.w.__exp_avg", "F32", [4, 3], struct.pack("<12f", *range(12))))
    write(os.path.join(d, "rank_0.safetensors"), safetensors_bytes(
        [(n, dt, [max(1, shape[0] * (shape[1] if len(shape) > 1 else 1))] if shape else [1], b)
         for n, dt, shape, b in ts]))
    md = {"tensors": {}}
    for n, dt, shape, b in ts:
        numel = 1
        for x in shape:
            numel *= x
        md["tensors"][n] = {"shape": shape, "is_sharded": False, "dtype": dt, "shard_spec_per_file": {
            "rank_0.safetensors": {"flattened_offsets": [[0, numel]], "local_shape": None, "global_offset": None}}}
    write(os.path.join(d, "metadata.json"), json.dumps(md).encode())


def _refused_by_every_command(case_name, d, outs, name, words, why):
    """Every command that reads the tensor bytes of checkpoint d (verify, digest, unshard, to-hf,
    to-dcp) exits 1 with `words`, and none leaves an output under outs."""
    for argv in (["verify", d], ["digest", d], ["unshard", d, os.path.join(outs, name + ".safetensors")],
                 ["to-hf", d, os.path.join(outs, name + "-hf")], ["to-dcp", d, os.path.join(outs, name + "-dcp")]):
        run(case_name, argv, 1, words)
    for left in (name + ".safetensors", name + "-hf", name + "-dcp"):
        p = os.path.join(outs, left)
        if os.path.exists(p) and (os.path.isfile(p) or os.listdir(p)):
            raise Failed(f"{name}: {left} was written{why}")


@case
def optim_pickles_every_command(t):
    """A model + optimizer pair whose optim/ pickles name os.system (11 ways: GLOBAL, STACK_GLOBAL,
    INST, OBJ, NEWOBJ, Python's own pickler, builtins.eval, inside a group's dict, in a second
    group, in state_keys): verify, digest, unshard, to-dcp and to-hf all exit 1 naming the tensor;
    the same pair with plain pickles passes every command."""
    base = os.path.join(t, "base")
    sharded_checkpoint(os.path.join(base, "model"))
    ok = os.path.join(t, "ok")
    shutil.copytree(base, ok)
    _optim(os.path.join(ok, "optim"), [_GOOD_GROUP], b"\x80\x02]X\x07\x00\x00\x00exp_avga.")
    outs = os.path.join(t, "out")
    os.makedirs(outs)
    run("optim_pickles_every_command", ["verify", ok], 0)
    run("optim_pickles_every_command", ["digest", ok], 0)
    run("optim_pickles_every_command", ["unshard", ok, os.path.join(outs, "ok.safetensors")], 0)
    run("optim_pickles_every_command", ["to-dcp", ok, os.path.join(outs, "ok-dcp")], 0)
    run("optim_pickles_every_command", ["to-hf", ok, os.path.join(outs, "ok-hf")], 0)
    for name, (groups, keys) in _evil_pickles().items():
        d = os.path.join(t, name)
        shutil.copytree(base, d)
        _optim(os.path.join(d, "optim"), groups, keys)
        tensor = "state_keys" if keys is not None else f"param_group{len(groups) - 1}"
        words = ["optim", f"'{tensor}'"]
        _refused_by_every_command("optim_pickles_every_command", d, outs, name, words, "")


_XXH = None


def _xxh3(b):
    """XXH3-64 (seed 0) of b, from the libxxhash the tool links (docs/FORMAT.md §2, "Checksums")."""
    global _XXH
    if _XXH is None:
        try:
            _XXH = ctypes.CDLL("libxxhash.so.0")
        except OSError as e:
            raise Failed(f"libxxhash.so.0 (the tool's xxHash) not found to write checksums: {e}")
        _XXH.XXH3_64bits.restype = ctypes.c_uint64
        _XXH.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    return "%016x" % _XXH.XXH3_64bits(b, len(b))


def _tensor_bytes(path):
    """{name: data bytes} of a safetensors file."""
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    return {k: data[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]
            for k, v in header.items() if k != "__metadata__"}


def add_checksums(d, block, sidecars=False):
    """Records the checksums of every rank file of the checkpoint in d (docs/FORMAT.md §2): in
    metadata.json, or (sidecars) in rank_R.checksums.json beside each."""
    md_path = os.path.join(d, "metadata.json")
    with open(md_path) as f:
        md = json.load(f)
    tables = {}
    for fn in sorted(os.listdir(d)):
        if fn.endswith(".safetensors"):
            tables[fn] = {k: [_xxh3(b[i:i + block]) for i in range(0, len(b), block)]
                          for k, b in _tensor_bytes(os.path.join(d, fn)).items()}
    cs = {"algorithm": "xxh3-64", "block_bytes": block, "files": {} if sidecars else tables}
    if sidecars:
        cs["sidecars"] = True
        for fn, table in tables.items():
            write(os.path.join(d, fn[:-len(".safetensors")] + ".checksums.json"), json.dumps(table).encode())
    md["shardsafe"] = {"checksums": cs}
    write(md_path, json.dumps(md).encode())


def flip_byte(path, at_from_end):
    with open(path, "r+b") as f:
        f.seek(-at_from_end, os.SEEK_END)
        b = f.read(1)
        f.seek(-at_from_end, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x40]))


@case
def checksums_every_command(t):
    """A checkpoint that records checksums (in metadata.json; in sidecars; the model/ of a pair)
    with one byte flipped in a rank file: verify, digest, unshard, to-hf and to-dcp all exit 1
    naming the file, the tensor and the file holding the hash; the undamaged copies pass."""
    outs = os.path.join(t, "out")
    os.makedirs(outs)
    made = {}
    for name, sidecars, pair in (("listed", False, False), ("sidecars", True, False), ("pair", False, True)):
        d = os.path.join(t, name)
        ck = os.path.join(d, "model") if pair else d
        sharded_checkpoint(ck)
        add_checksums(ck, 8, sidecars)
        good = os.path.join(t, name + "-good")
        shutil.copytree(d, good)
        run("checksums_every_command", ["verify", good], 0)
        out, _ = run("checksums_every_command", ["digest", good], 0)
        made[name] = out
        run("checksums_every_command", ["unshard", good, os.path.join(outs, name + "-good.safetensors")], 0)
        # w's last element: rank 1's data ends the file
        flip_byte(os.path.join(ck, "rank_1.safetensors"), 2)
        holder = "rank_1.checksums.json" if sidecars else "metadata.json"
        words = ["rank_1.safetensors", "tensor 'w'", holder, "damaged"]
        _refused_by_every_command("checksums_every_command", d, outs, name, words, " from damaged bytes")


@case
def checksums_cost(t):
    """The checks' cost: a 64 MiB tensor over two ranks with checksums in 4 MiB blocks, and in one
    block per tensor (block_bytes 2^40: every window of an export reads its block again), through
    digest, unshard, to-hf and to-dcp, within the limits."""
    n = 16 << 20  # F32 elements: 32 MiB a rank
    half = bytes(range(256)) * (n * 4 // 2 // 256)
    for block in (4 << 20, 1 << 40):
        d = os.path.join(t, f"b{block}")
        write(os.path.join(d, "rank_0.safetensors"), safetensors_bytes([("w", "F32", [n // 2], half)]))
        write(os.path.join(d, "rank_1.safetensors"), safetensors_bytes([("w", "F32", [n // 2], half[::-1])]))
        md = {"tensors": {"w": {"shape": [n // 1024, 1024], "is_sharded": True, "dtype": "F32", "shard_spec_per_file": {
            "rank_0.safetensors": {"flattened_offsets": [[0, n // 2]], "local_shape": None, "global_offset": None},
            "rank_1.safetensors": {"flattened_offsets": [[n // 2, n]], "local_shape": None, "global_offset": None}}}}}
        write(os.path.join(d, "metadata.json"), json.dumps(md).encode())
        add_checksums(d, block)
        o = os.path.join(t, f"o{block}")
        os.makedirs(o)
        run("checksums_cost", ["digest", d], 0)
        run("checksums_cost", ["unshard", d, os.path.join(o, "u.safetensors")], 0)
        run("checksums_cost", ["to-hf", d, os.path.join(o, "hf")], 0)
        run("checksums_cost", ["to-dcp", d, os.path.join(o, "dcp")], 0)
        shutil.rmtree(o)


@case
def export_unnamed_tensor(t):
    """A .pt whose tensor is keyed '' and one that is the pickle's root (torch.save of a bare
    tensor), alone and beside a named tensor: to-dcp and to-hf exit 1 naming the tensor and why it
    has no name, not the rename rules (none were given); with a rule given that does not name it,
    the message says so; a rule that names it exports it."""
    four = {"0": ("FloatStorage", 4, struct.pack("<4f", 1, 2, 3, 4))}
    files = {"empty_key": torch_save_bytes({"": ("0", 0, (4,), (1,))}, four),
             "empty_key_and_a": torch_save_bytes({"": ("0", 0, (4,), (1,)), "a": ("0", 0, (2,), (1,))}, four),
             "root": torch_zip_of(pickled_tensor(b"0", 4), {"data/0": four["0"][2]})}
    why = {"empty_key": "has an empty name", "empty_key_and_a": "has an empty name", "root": "root of the pickle"}
    for name, data in files.items():
        pt = os.path.join(t, name + ".pt")
        write(pt, data)
        for cmd in ("to-dcp", "to-hf"):
            o = os.path.join(t, f"{name}-{cmd}")
            _, err = run("export_unnamed_tensor", [cmd, pt, o], 1, ["tensor ''", name + ".pt", why[name]])
            if "rename" in err:
                raise Failed(f"{cmd} {name}: the message blames rename rules that were not given: {err}")
            if os.path.exists(o) and os.listdir(o):
                raise Failed(f"{cmd} {name}: {o} was written")
            o = os.path.join(t, f"{name}-{cmd}-rule")
            run("export_unnamed_tensor", [cmd, pt, o, "--rename", "^x$=y"], 1,
                ["tensor ''", why[name], "no rename rule names it"])
            out, _ = run("export_unnamed_tensor", [cmd, pt, os.path.join(t, f"{name}-{cmd}-named"), "--rename", "^$=w"], 0)
            if ("2 tensors" if name == "empty_key_and_a" else "1 tensors") not in out:
                raise Failed(f"{cmd} {name} with '^$=w': {out!r}")


@case
def export_unnamed_value(t):
    """A training .pt whose value (not a tensor) is keyed '', alone and beside another value
    (found by fuzz_dcp_write): to-dcp exits 1 naming the value and why it has no name, not
    rename rules never given; before, the first was blamed on rename rules and the second exported
    without the value, exit 0. A rule that names it exports it."""
    files = {"value_alone": torch_save_bytes({}, {}, value={"": 7}),
             "value_beside": torch_save_bytes({}, {}, value={"": 7, "epoch": 3})}
    for name, data in files.items():
        pt = os.path.join(t, name + ".pt")
        write(pt, data)
        o = os.path.join(t, name + "-dcp")
        _, err = run("export_unnamed_value", ["to-dcp", pt, o], 1, ["value ''", name + ".pt", "has an empty name"])
        if "rename" in err:
            raise Failed(f"to-dcp {name}: the message blames rename rules that were not given: {err}")
        if os.path.exists(o) and os.listdir(o):
            raise Failed(f"to-dcp {name}: {o} was written")
        run("export_unnamed_value", ["to-dcp", pt, os.path.join(t, name + "-named"), "--rename", "^$=v"], 0)
        if not os.path.exists(os.path.join(t, name + "-named", ".metadata")):
            raise Failed(f"to-dcp {name} with '^$=v' wrote no .metadata")


@case
def export_drops_every_key(t):
    """--rename '^.*$=' drops every key: to-dcp exits 1 naming the rule (as to-hf does), and writes
    no folder of nothing."""
    x = os.path.join(t, "x.safetensors")
    write(x, safetensors_bytes([("a", "F32", [1], struct.pack("<f", 1)), ("b", "F32", [1], struct.pack("<f", 2))]))
    ck = os.path.join(t, "ck")
    sharded_checkpoint(ck)
    for src in (x, ck):
        for cmd in ("to-dcp", "to-hf"):
            o = os.path.join(t, cmd + os.path.basename(src))
            run("export_drops_every_key", [cmd, src, o, "--rename", "^.*$="], 1, ["drop all 2", "'^.*$='"])
            if os.path.exists(o) and os.listdir(o):
                raise Failed(f"{cmd}: {o} was written")


@case
def json_structure(t):
    """Texts simdjson's On-Demand reading took for JSON though they are not (a ':' where a ','
    belongs, a '}' too many; found by fuzz_metadata): refused as JSON by every command, in a
    metadata.json and a model.safetensors.index.json alike."""
    outs = os.path.join(t, "out")
    os.makedirs(outs)
    d = os.path.join(t, "ck")
    sharded_checkpoint(d)
    write(os.path.join(d, "metadata.json"), json.dumps(json.load(open(os.path.join(d, "metadata.json"))))[:-1].encode() +
          b', "shardsafe": "x": 1}}')
    refused_by_all("json_structure", d, outs, ["metadata.json", "not valid JSON", "expected ',' or '}'"])
    hf = os.path.join(t, "hf")
    os.makedirs(hf)
    write(os.path.join(hf, "model-00001-of-00001.safetensors"), safetensors_bytes([("w", "U8", [2], b"\x01\x02")]))
    write(os.path.join(hf, "model.safetensors.index.json"),
          b'{"metadata": {}, "weight_map": {"w": "model-00001-of-00001.safetensors"}, "x": "y": 1}}')
    refused_by_all("json_structure", hf, outs, ["model.safetensors.index.json", "not valid JSON"])
