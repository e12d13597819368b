"""Hostile inputs against the shardsafe tool, each case a process measured on its own (issue 30).

    python3 tests/hostile/hostile.py TOOL [CASE...]

Every case builds its input in a temporary folder (nothing is committed but this script), runs
the tool once (or a few times) and checks: the exit code (0 where the input is valid, 1 with one
line on stderr naming what the case names; never a signal), the line's words, that nothing the
case protects changed, and the limits of the issue: each command uses at most LIMIT_S seconds of CPU and
its peak RSS (wait4's ru_maxrss of that process alone) stays under LIMIT_MIB. Time is the
command's CPU time (user + system, from wait4): the work it did, not how busy the machine was; a
command still running after WALL_FACTOR x LIMIT_S wall seconds (waiting, e.g. blocked on a FIFO)
is killed and the case fails. The last lines are a table of every command: case, exit,
CPU seconds, peak MiB, wall seconds. Exit 0 when every case passes.

Under sanitizers (a tool built with -Db_sanitize=address,undefined), set
SHARDSAFE_HOSTILE_SANITIZED=1: ASan's shadow memory and quarantine and the instrumented code
would break the limits, so LIMIT_S is multiplied by SANITIZED_CPU_FACTOR (10), LIMIT_MIB by
SANITIZED_RSS_FACTOR (16) and a case's call-stack limit by SANITIZED_STACK_FACTOR (8), a case's own
limits as the defaults; the tool runs with ASAN_OPTIONS and UBSAN_OPTIONS that abort on the
first report (kept where already set), and a case fails on any sanitizer report on stderr,
whatever the exit code. The limits then check only gross blow-ups; the plain build checks the
real ones.

Cases: the names below, and those of the files cases_*.py beside this one (one per subject,
with this file's helpers in scope): `python3 tests/hostile/hostile.py TOOL --list`.
"""
import hashlib
import io
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

LIMIT_S = 30.0      # CPU seconds per command
WALL_FACTOR = 4     # wall seconds per command before it is killed, in multiples of LIMIT_S
LIMIT_MIB = 256.0
SANITIZED = os.environ.get("SHARDSAFE_HOSTILE_SANITIZED", "") not in ("", "0")
SANITIZED_CPU_FACTOR = 10
SANITIZED_RSS_FACTOR = 16
SANITIZED_STACK_FACTOR = 8  # a case's call-stack limit: ASan's frames hold redzones (1,000 levels passed 1 MiB)
SANITIZER_REPORTS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:", "SUMMARY: UndefinedBehavior")
if SANITIZED:
    LIMIT_S *= SANITIZED_CPU_FACTOR
    LIMIT_MIB *= SANITIZED_RSS_FACTOR
    os.environ.setdefault("ASAN_OPTIONS", "abort_on_error=1:detect_leaks=1")
    os.environ.setdefault("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1:abort_on_error=1")
HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.dirname(os.path.dirname(HERE))
TOOL = None
RESULTS = []  # (case, argv summary, exit, seconds, MiB)


class Failed(Exception):
    pass


def run(case, args, expect_exit, words=(), limit_s=None, limit_mib=None, nofile=None, stack_kib=None):
    """Runs the tool once; checks exit, stderr words and the limits (the peak RSS is the tool
    process's own: os.wait4; stack_kib, when given, limits its call stack); returns (stdout, stderr).
    A case's own limits are widened under SANITIZED as the defaults are."""
    limit_s = LIMIT_S if limit_s is None else limit_s * (SANITIZED_CPU_FACTOR if SANITIZED else 1)
    limit_mib = LIMIT_MIB if limit_mib is None else limit_mib * (SANITIZED_RSS_FACTOR if SANITIZED else 1)
    if stack_kib and SANITIZED:
        stack_kib *= SANITIZED_STACK_FACTOR
    t0 = time.monotonic()
    r, w = os.pipe()
    e_r, e_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.close(e_r)
        if nofile:
            import resource
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        if stack_kib:
            import resource
            resource.setrlimit(resource.RLIMIT_STACK, (stack_kib << 10, stack_kib << 10))
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(w, 1)
        os.dup2(e_w, 2)
        try:
            os.execv(TOOL, [TOOL] + args)
        finally:
            os._exit(127)
    os.close(w)
    os.close(e_w)
    # the limit is on CPU time (the work done, the same on a loaded machine); a command that
    # waits (a hang in open() on a FIFO uses no CPU) is killed at WALL_FACTOR times the limit
    deadline = t0 + WALL_FACTOR * limit_s + 5
    out, err = [], []  # joined at the end: += on bytes copies all so far (quadratic in 100 MB of output)
    import selectors
    sel = selectors.DefaultSelector()
    sel.register(r, selectors.EVENT_READ, "out")
    sel.register(e_r, selectors.EVENT_READ, "err")
    killed = False
    open_fds = 2
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0 and not killed:
            os.kill(pid, signal.SIGKILL)
            killed = True
        for key, _ in sel.select(timeout=max(0.05, min(left, 1.0)) if not killed else 1.0):
            data = os.read(key.fd, 65536)
            if not data:
                sel.unregister(key.fd)
                os.close(key.fd)
                open_fds -= 1
            elif key.data == "out":
                out.append(data)
            else:
                err.append(data)
    out, err = b"".join(out), b"".join(err)
    _, status, ru = os.wait4(pid, 0)
    wall = time.monotonic() - t0
    secs = ru.ru_utime + ru.ru_stime
    mib = ru.ru_maxrss / 1024.0
    code = os.waitstatus_to_exitcode(status)
    RESULTS.append((case, " ".join(a if len(a) < 40 else a[:37] + "..." for a in args[:3]), code, secs, mib, wall))
    text = err.decode("utf-8", "replace")
    if SANITIZED and any(m in text for m in SANITIZER_REPORTS):
        raise Failed(f"{args[0]}: sanitizer report (exit {code}): {text[-3000:]}")
    if killed:
        raise Failed(f"{args[0]} still running after {WALL_FACTOR * limit_s + 5:.0f} s: killed")
    if code < 0:
        raise Failed(f"{args[0]} died of signal {-code}: {text[-400:]}")
    if secs > limit_s:
        raise Failed(f"{args[0]} took {secs:.1f} CPU s (limit {limit_s} s)")
    if mib > limit_mib:
        raise Failed(f"{args[0]} peaked at {mib:.0f} MiB (limit {limit_mib} MiB)")
    if code != expect_exit:
        raise Failed(f"{args[0]} exited {code}, expected {expect_exit}; stderr: {text[-600:]}")
    if expect_exit == 1:
        lines = [l for l in text.split("\n") if l]
        if len(lines) != 1:
            raise Failed(f"{args[0]}: {len(lines)} lines on stderr, expected one: {text[-600:]}")
    for w in words:
        if w not in text:
            raise Failed(f"{args[0]}: stderr lacks {w!r}: {text[-600:]}")
    return out.decode("utf-8", "replace"), text



# --- fixtures --------------------------------------------------------------------------------


def safetensors_bytes(tensors, metadata=None, fields=None):
    """tensors: list of (name, dtype, shape, bytes); fields: more of each entry (that readers ignore)."""
    header, off, data = {}, 0, b""
    for name, dt, shape, b in tensors:
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(b)], **(fields or {})}
        off += len(b)
        data += b
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + data


def write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def sharded_checkpoint(d, extra_rank1=()):
    """A 2-rank checkpoint of w [4, 3] F32 (rows split) and b [3] (rank 0): metadata.json + rank files."""
    w = struct.pack("<12f", *range(12))
    b = struct.pack("<3f", 1, 2, 3)
    write(os.path.join(d, "rank_0.safetensors"), safetensors_bytes([("w", "F32", [6], w[:24]), ("b", "F32", [3], b)]))
    write(os.path.join(d, "rank_1.safetensors"), safetensors_bytes([("w", "F32", [6], w[24:])] + list(extra_rank1)))
    md = {"tensors": {
        "w": {"shape": [4, 3], "is_sharded": True, "dtype": "F32", "shard_spec_per_file": {
            "rank_0.safetensors": {"flattened_offsets": [[0, 6]], "local_shape": None, "global_offset": None},
            "rank_1.safetensors": {"flattened_offsets": [[6, 12]], "local_shape": None, "global_offset": None}}},
        "b": {"shape": [3], "is_sharded": False, "dtype": "F32", "shard_spec_per_file": {
            "rank_0.safetensors": {"flattened_offsets": [[0, 3]], "local_shape": None, "global_offset": None}}}}}
    write(os.path.join(d, "metadata.json"), json.dumps(md).encode())


def hf_folder(d, sharded):
    t = [("a", "F32", [2], struct.pack("<2f", 1, 2)), ("b", "F32", [1], struct.pack("<f", 3))]
    if not sharded:
        write(os.path.join(d, "model.safetensors"), safetensors_bytes(t))
        return
    write(os.path.join(d, "model-00001-of-00002.safetensors"), safetensors_bytes(t[:1]))
    write(os.path.join(d, "model-00002-of-00002.safetensors"), safetensors_bytes(t[1:]))
    write(os.path.join(d, "model.safetensors.index.json"), json.dumps(
        {"metadata": {"total_size": 12}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                         "b": "model-00002-of-00002.safetensors"}}).encode())


def dcp_folder(d):
    shutil.copytree(os.path.join(SOURCE, "tests", "fixtures", "dcp_torch2", "ckpt"), d)


def digest_of_folder(d):
    h = {}
    for n in sorted(os.listdir(d)):
        p = os.path.join(d, n)
        if os.path.isfile(p):
            with open(p, "rb") as f:
                h[n] = hashlib.sha256(f.read()).hexdigest()
    return h


def replace_with_fifo(path):
    os.remove(path)
    os.mkfifo(path)


# --- cases ----------------------------------------------------------------------------------

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


@case
def long_name_rename(t):
    """to-hf of a 30,000-character name, with the preset and with the README's rule: no crash."""
    name = "model." + "x" * 30000
    write(os.path.join(t, "in.safetensors"), safetensors_bytes([(name, "F32", [1], struct.pack("<f", 1))]))
    run("long_name_rename", ["to-hf", os.path.join(t, "in.safetensors"), os.path.join(t, "o1"), "--preset", "dcp-to-hf"], 0)
    run("long_name_rename", ["to-hf", os.path.join(t, "in.safetensors"), os.path.join(t, "o2"), "--rename", r"^model\.(.*)=\1"], 0)


@case
def catastrophic_rename(t):
    """--rename '^(a+)+$=x' on names a backtracking engine takes exponential time over."""
    names = ["a" * 40 + "b", "a" * 20000 + "!"]
    write(os.path.join(t, "in.safetensors"),
          safetensors_bytes([(n, "F32", [1], struct.pack("<f", i)) for i, n in enumerate(names)]))
    run("catastrophic_rename", ["to-hf", os.path.join(t, "in.safetensors"), os.path.join(t, "o"), "--rename", "^(a+)+$=x"], 0)


@case
def unshard_over_input(t):
    """unshard onto a file of the checkpoint it reads: refused, nothing changed."""
    ck = os.path.join(t, "ckpt")
    sharded_checkpoint(ck)
    before = digest_of_folder(ck)
    for target in ("rank_0.safetensors", "metadata.json", "new.safetensors"):
        run("unshard_over_input", ["unshard", ck, os.path.join(ck, target)], 1, ["inside the input folder"])
    dc = os.path.join(t, "dcp")
    dcp_folder(dc)
    dbefore = digest_of_folder(dc)
    for target in (".metadata", "__0_0.distcp"):
        run("unshard_over_input", ["unshard", dc, os.path.join(dc, target)], 1, ["inside the input folder"])
    run("unshard_over_input", ["to-hf", ck, os.path.join(ck, "hf")], 1, ["inside the input folder"])
    run("unshard_over_input", ["to-dcp", ck, os.path.join(ck, "dcp")], 1, ["inside the input folder"])
    # one of the checkpoint's files under another name (a hard link elsewhere) is refused too
    alias = os.path.join(t, "alias.safetensors")
    os.link(os.path.join(ck, "rank_0.safetensors"), alias)
    run("unshard_over_input", ["unshard", ck, alias], 1, ["under another name"])
    run("unshard_over_input", ["unshard", ck, os.path.join(t, "fine.safetensors")], 0)
    if digest_of_folder(ck) != before or digest_of_folder(dc) != dbefore:
        raise Failed("a refused command changed the checkpoint it read")


@case
def fifo_inputs(t):
    """A FIFO where a file of each layout should be: every command ends at once, naming it."""
    makers = [(sharded_checkpoint, "metadata.json"), (sharded_checkpoint, "rank_1.safetensors"),
              (lambda d: hf_folder(d, False), "model.safetensors"),
              (lambda d: hf_folder(d, True), "model.safetensors.index.json"),
              (lambda d: hf_folder(d, True), "model-00002-of-00002.safetensors"),
              (dcp_folder, ".metadata"), (dcp_folder, "__1_0.distcp")]
    layouts = []
    for i, (make, name) in enumerate(makers):
        folder = os.path.join(t, "layout%d" % i)
        make(folder)
        layouts.append((folder, name))
    for folder, name in layouts:
        replace_with_fifo(os.path.join(folder, name))
        for cmd in (["verify", folder], ["digest", folder]):
            run("fifo_inputs", cmd, 1, [name, "FIFO"])
    one = os.path.join(t, "pipe.safetensors")
    os.mkfifo(one)
    run("fifo_inputs", ["inspect", one], 1, ["not a regular file"])



def pickle_metadata_many_builds(n_builds):
    """A torch 2.x .metadata pickle whose Metadata object gets n BUILDs of one new entry each."""
    mod = b"torch.distributed.checkpoint.metadata"
    out = b"\x80\x02c" + mod + b"\nMetadata\n)\x81"
    for i in range(n_builds):
        k = b"k%d" % i
        out += b"}X" + struct.pack("<I", len(k)) + k + b"Nsb"
    # a valid state at last: no tensors
    out += b"}X" + struct.pack("<I", 19) + b"state_dict_metadata" + b"}sb."
    return out


@case
def repeated_build(t):
    """A .metadata of ~900 KB whose object gets 90,000 BUILDs: every opcode O(1) amortized."""
    d = os.path.join(t, "dcp")
    os.makedirs(d)
    write(os.path.join(d, ".metadata"), pickle_metadata_many_builds(90000))
    run("repeated_build", ["inspect", d], 0)


def torch_like_metadata(tensors, path="__0_0.distcp", one_chunk=False, places=None, planner_data=None):
    """The bytes of a `.metadata` pickled as torch 2.x pickles it (Python's own pickler, protocol 4,
    every object memoized), for the classes of torch.distributed.checkpoint made here under their
    torch module names. `tensors`: [(fqn, rows, chunks)], each an F32 [rows, 4] tensor split into
    `chunks` row blocks, all in the data file `path` (one str object: the memo holds it once);
    with one_chunk, `chunks` references to one chunk of all the rows instead. No data file is
    written: a chunk's (offset, length) in it are places[(fqn, c)], or by default as if its rows
    were stored raw. planner_data: the value pickled as Metadata's (default None)."""
    import dataclasses
    import enum
    import pickle
    import types
    names = ["torch", "torch.serialization", "torch.distributed", "torch.distributed.checkpoint",
             "torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"]
    saved = {n: sys.modules.get(n) for n in names}
    mods = {n: types.ModuleType(n) for n in names}
    sys.modules.update(mods)
    try:
        torch, ser, md, fs = (mods[n] for n in (names[0], names[1], names[4], names[5]))

        def put(mod, obj, name):
            obj.__module__, obj.__qualname__, obj.__name__ = mod.__name__, name, name
            setattr(mod, name, obj)
            return obj

        class Size(tuple):
            def __reduce__(self):
                return (Size, (tuple(self),))
        put(torch, Size, "Size")

        class DType:
            __module__ = "torch"

            def __reduce__(self):
                return "float32"
        torch.float32 = DType()

        def get_layout(name):
            return name
        put(ser, get_layout, "_get_layout")

        class Layout:
            def __reduce__(self):
                return (get_layout, ("torch.strided",))

        class Mem(enum.Enum):
            TORCH_CONTIGUOUS_FORMAT = 0
        put(md, Mem, "_MEM_FORMAT_ENCODING")

        class TensorProperties:
            def __getstate__(self):
                return (torch.float32, Layout(), False, Mem.TORCH_CONTIGUOUS_FORMAT, False)
        put(md, TensorProperties, "TensorProperties")
        dc = {}
        for name, fields, frozen in (("ChunkStorageMetadata", "offsets sizes", False),
                                     ("TensorStorageMetadata", "properties size chunks", False),
                                     ("MetadataIndex", "fqn offset index", True),
                                     ("Metadata", "state_dict_metadata planner_data storage_data storage_meta", False)):
            dc[name] = put(md, dataclasses.make_dataclass(name, fields.split(), frozen=frozen), name)
        StorageInfo = put(fs, dataclasses.make_dataclass("_StorageInfo", ["relative_path", "offset", "length"]), "_StorageInfo")
        sdm, storage = {}, {}
        for fqn, rows, chunks in tensors:
            if one_chunk:
                whole = dc["ChunkStorageMetadata"](Size((0, 0)), Size((rows, 4)))
                sdm[fqn] = dc["TensorStorageMetadata"](TensorProperties(), Size((rows, 4)), [whole] * chunks)
                storage[dc["MetadataIndex"](fqn, Size((0, 0)), 0)] = StorageInfo(path, 0, rows * 16)
                continue
            step = rows // chunks
            blocks = [(c * step, step if c < chunks - 1 else rows - c * step) for c in range(chunks)]
            sdm[fqn] = dc["TensorStorageMetadata"](TensorProperties(), Size((rows, 4)),
                                                   [dc["ChunkStorageMetadata"](Size((o, 0)), Size((n, 4))) for o, n in blocks])
            for c, (o, n) in enumerate(blocks):
                at, length = places[(fqn, c)] if places else (o * 16, n * 16)
                storage[dc["MetadataIndex"](fqn, Size((o, 0)), c)] = StorageInfo(path, at, length)
        return pickle.dumps(dc["Metadata"](sdm, planner_data, storage, None), protocol=4)
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


@case
def metadata_memory(t):
    """.metadata as torch writes it: 2 tensors of 60,000 chunks (15 MB, over a million memo entries)
    read in a small multiple of its size; 100,000 chunks of one tensor refused, in the same bounds."""
    d = os.path.join(t, "dcp")
    os.makedirs(d)
    write(os.path.join(d, ".metadata"), torch_like_metadata([("a", 120000, 60000), ("b", 120000, 60000)]))
    out, _ = run("metadata_memory", ["inspect", d], 0)
    if "60000" not in out:
        raise Failed("inspect said: " + out[:300])
    write(os.path.join(d, ".metadata"), torch_like_metadata([("a", 200000, 100000)]))
    run("metadata_memory", ["inspect", d], 1, [".metadata", "'a'", "more than 65536 chunks"])


@case
def metadata_json_memory(t):
    """A valid metadata.json of 27 MB (262 ranks x 1,000 tensors, OLMo-core's layout; at most 2^18
    entries), read in a small multiple of its size (the DOM and every spec's index cost 6x its size; now 4x)."""
    ranks, tensors = 262, 1000
    d = os.path.join(t, "ckpt")
    names = [f"model.layers.{i}.mlp.weight" for i in range(tensors)]
    for r in range(ranks):
        write(os.path.join(d, f"rank_{r}.safetensors"),
              safetensors_bytes([(n, "F32", [1], struct.pack("<f", r)) for n in names]))
    md = {"tensors": {n: {"shape": [ranks], "is_sharded": True, "dtype": "F32", "shard_spec_per_file": {
        f"rank_{r}.safetensors": {"flattened_offsets": [[r, r + 1]], "local_shape": None, "global_offset": None}
        for r in range(ranks)}} for n in names}}
    text = json.dumps(md).encode()
    write(os.path.join(d, "metadata.json"), text)
    out, _ = run("metadata_json_memory", ["inspect", d], 0)
    if str(tensors) not in out:
        raise Failed("inspect said: " + out[:300])
    run("metadata_json_memory", ["verify", d], 0)


@case
def named_again_and_again(t):
    """Long names that small bytes name many times (a key in every file's context, a str the
    pickle memo holds once and each entry refers to, paths kept per object met): read in time and
    memory bounded by the input, or refused as expanding too far."""
    # a safetensors header: a tensor of a 64 KiB name with 16,000 empty objects in a field readers
    # ignore (valid): the duplicate-key walk once kept each object's path, 1 GB in all
    st = os.path.join(t, "long.safetensors")
    write(st, safetensors_bytes([("n" * 65536, "U8", [1], b"\x07")], fields={"x": [{}] * 16000}))
    out, _ = run("named_again_and_again", ["digest", st], 0)
    if "U8 [1]" not in out:
        raise Failed("digest said: " + out[:200])
    # metadata.json: a 4 MB tensor key over 8,000 files (its context once copied the key for
    # each: 100 CPU s), the last file's range past the tensor
    ck = os.path.join(t, "ckpt")
    files = {f"r{i}": {"flattened_offsets": [[0, 1]]} for i in range(8000)}
    files["r7999"] = {"flattened_offsets": [[0, 2]]}
    write(os.path.join(ck, "metadata.json"), json.dumps(
        {"tensors": {"k" * 4_000_000: {"shape": [1], "dtype": "U8", "is_sharded": True, "shard_spec_per_file": files}}}).encode())
    run("named_again_and_again", ["inspect", ck], 1, ["metadata.json", "file 'r7999'", "(4000000 bytes)"])
    # DCP .metadata: a 1 MB data file name that 1,000 chunks refer to (copied into each: 2 GB)
    d = os.path.join(t, "dcp_path")
    write(os.path.join(d, ".metadata"), torch_like_metadata([("w", 1000, 1000)], path="p" * 1_000_000))
    run("named_again_and_again", ["inspect", d], 1, [".metadata", "expands to more than", "strings count 1 per 8 bytes"])
    # DCP .metadata: a 16 MB tensor name whose one chunk is listed 60,000 times (the chunks' contexts
    # once copied the name for each, and looking each up compared it again: 2 TB of both)
    d = os.path.join(t, "dcp_fqn")
    write(os.path.join(d, ".metadata"), torch_like_metadata([("f" * 16_000_000, 8, 60000)], one_chunk=True))
    out, _ = run("named_again_and_again", ["inspect", d], 0)
    if "[8,4]" not in out and "[8, 4]" not in out:
        raise Failed("inspect said: " + out[:300])


def _pickle_i(v):
    return b"J" + struct.pack("<i", v)


def dcp_f32_archive(sizes, stride, values):
    """The torch.save archive of one F32 chunk as a DCP data file holds it: data.pkl gives
    `sizes` and `stride`, its storage holds `values` (floats, in storage order)."""
    import zipfile

    def tup(vals):
        return b"(" + b"".join(_pickle_i(v) for v in vals) + b"t"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        pkl = (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storagectorch\nFloatStorage\n"
               b"X\x01\x00\x00\x000X\x03\x00\x00\x00cpu" + _pickle_i(len(values)) + b"tQK\x00" + tup(sizes) +
               tup(stride) + b"\x89ccollections\nOrderedDict\n)RtR.")
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/data/0", values.tobytes() if hasattr(values, "tobytes") else struct.pack(f"<{len(values)}f", *values))
        z.writestr("archive/version", "3\n")
    return buf.getvalue()


def dcp_f32_folder(d, shape, chunks, mcore_data=None):
    """A DCP folder of one F32 tensor 'w' of `shape`, pickled as torch writes it, its chunks
    [(offsets, sizes, stride, values)] one torch.save archive each in __0_0.distcp, in order
    (dcp_f32_archive). mcore_data: (a dict of str to a dict of str to a tuple of ints) the
    Metadata is Megatron-Core's MCoreMetadata (core <= 0.15) with that mcore_data field."""
    def s(x):
        x = x.encode()
        return b"X" + struct.pack("<I", len(x)) + x

    i = _pickle_i
    data, at, places = [], 0, []
    for _, sizes, stride, values in chunks:
        a = dcp_f32_archive(sizes, stride, values)
        places.append((at, len(a)))
        data.append(a)
        at += len(a)
    write(os.path.join(d, "__0_0.distcp"), b"".join(data))

    def size(vals):
        return b"ctorch\nSize\n(" + b"".join(i(v) for v in vals) + b"t\x85R"
    m = b"torch.distributed.checkpoint.metadata"
    fsm = b"torch.distributed.checkpoint.filesystem"

    def obj(mod, cls, state):
        return b"c" + mod + b"\n" + cls + b"\n)\x81" + state + b"b"
    props = obj(m, b"TensorProperties", b"(ctorch\nfloat32\nctorch.serialization\n_get_layout\n" + s("torch.strided") +
                b"\x85R\x89c" + m + b"\n_MEM_FORMAT_ENCODING\nK\x00\x85R\x89t")

    def batched(items, close):  # MARK ... APPENDS/SETITEMS per 1000 items, as Python's pickler
        return b"".join(b"(" + b"".join(items[k:k + 1000]) + close for k in range(0, len(items), 1000))
    chunk_objs = [obj(m, b"ChunkStorageMetadata", b"}(" + s("offsets") + size(off) + s("sizes") + size(sz) + b"u")
                  for off, sz, _, _ in chunks]
    tsm = obj(m, b"TensorStorageMetadata", b"}(" + s("properties") + props + s("size") + size(shape) + s("chunks") +
              b"]" + batched(chunk_objs, b"e") + b"u")
    storage = [obj(m, b"MetadataIndex", b"}(" + s("fqn") + s("w") + s("offset") + size(off) + b"u") +
               obj(fsm, b"_StorageInfo", b"}(" + s("relative_path") + s("__0_0.distcp") + s("offset") +
                   i(places[c][0]) + s("length") + i(places[c][1]) + b"u")
               for c, (off, _, _, _) in enumerate(chunks)]
    cls, extra = (m, b"Metadata"), b""
    if mcore_data is not None:
        cls = (b"megatron.core.dist_checkpointing.strategies.torch", b"MCoreMetadata")
        extra = s("mcore_data") + b"}(" + b"".join(
            s(k) + b"}(" + b"".join(s(f) + b"(" + b"".join(i(x) for x in v) + b"t" for f, v in fields.items()) + b"u"
            for k, fields in mcore_data.items()) + b"u"
    md = b"\x80\x02" + obj(cls[0], cls[1], b"}(" + s("state_dict_metadata") + b"}" + s("w") + tsm + b"s" +
                             s("storage_data") + b"}" + batched(storage, b"u") + extra + b"u") + b"."
    write(os.path.join(d, ".metadata"), md)


def dcp_overlapping(d, chunks):
    """A DCP folder of one F32 tensor [chunks + 1, 4] whose chunks each hold 2 rows, overlapping
    their neighbours by one row (every element but the first and last rows held twice, equal)."""
    full = [float(i) for i in range((chunks + 1) * 4)]
    dcp_f32_folder(d, [chunks + 1, 4], [([c, 0], [2, 4], [4, 1], full[c * 4:(c + 2) * 4]) for c in range(chunks)])


@case
def verify_overlapping_chunks(t):
    """verify of a DCP folder of 5,001 chunks overlapping their neighbours: O(n log n), not cubic."""
    d = os.path.join(t, "dcp")
    dcp_overlapping(d, 5001)
    out, _ = run("verify_overlapping_chunks", ["verify", d], 0)
    if "1 tensors valid" not in out or "replicas" not in out:
        raise Failed("verify said: " + out)


@case
def permuted_chunks(t):
    """DCP chunks whose bytes hold their dimensions in another order (torch.save keeps a transposed
    tensor's strides), beside row-major ones: read as Python computes them; a transposed chunk of
    [2, 2^22] cut into one-element runs in bounded memory; shared elements of a transposed chunk
    refused by name where they cannot be compared or taken in part."""
    def transposed(values, rows, cols):  # row-major [rows, cols] values, stored column by column
        return [values[r * cols + c] for c in range(cols) for r in range(rows)]

    def digest_line(shape, raw):  # `shardsafe digest`'s line for F32 tensor w of these bytes
        return f"w F32 [{','.join(map(str, shape))}] {hashlib.sha256(raw).hexdigest()}"
    full = [float(i) * 0.5 - 3 for i in range(16)]
    full_bytes = struct.pack("<16f", *full)
    rows = lambda a, b: full[a * 4:b * 4]  # noqa: E731
    # A: rows 0-1 transposed; B: rows 2-3; C: row 3 again (B and C overlap, equal)
    d = os.path.join(t, "mixed")
    dcp_f32_folder(d, [4, 4], [([0, 0], [2, 4], [1, 2], transposed(rows(0, 2), 2, 4)), ([2, 0], [2, 4], [4, 1], rows(2, 4)),
                               ([3, 0], [1, 4], [4, 1], rows(3, 4))])
    out, _ = run("permuted_chunks", ["digest", d], 0)
    if out.strip() != digest_line([4, 4], full_bytes):
        raise Failed("digest said " + out.strip() + ", Python " + digest_line([4, 4], full_bytes))
    out, _ = run("permuted_chunks", ["verify", d], 0)  # B and C compared; A shares nothing
    if "1 tensors valid" not in out:
        raise Failed("verify said: " + out)
    # converted while scattered: F16 as Python's struct rounds it (every value here is exact in F16)
    run("permuted_chunks", ["to-hf", d, os.path.join(t, "hf16"), "--dtype", "f16"], 0)
    with open(os.path.join(t, "hf16", "model.safetensors"), "rb") as f:
        b = f.read()
    n = struct.unpack("<Q", b[:8])[0]
    e = json.loads(b[8:8 + n])["w"]
    got = b[8 + n + e["data_offsets"][0]:8 + n + e["data_offsets"][1]]
    if e["dtype"] != "F16" or got != struct.pack("<16e", *full):
        raise Failed(f"to-hf --dtype f16 wrote {e['dtype']} {got.hex()}")
    # A': rows 2-3 transposed, overlapping C: loaded whole from A' (C compared), not compared by verify
    d = os.path.join(t, "shared")
    dcp_f32_folder(d, [4, 4], [([0, 0], [2, 4], [4, 1], rows(0, 2)), ([3, 0], [1, 4], [4, 1], rows(3, 4)),
                               ([2, 0], [2, 4], [1, 2], transposed(rows(2, 4), 2, 4))])
    out, _ = run("permuted_chunks", ["digest", d], 0)
    if out.strip() != digest_line([4, 4], full_bytes):
        raise Failed("digest of the shared folder said " + out.strip())
    run("permuted_chunks", ["verify", d], 1, ["tensor 'w'", "stores its dimensions in the order [1,0]",
                                              "verify compares shared elements of row-major chunks only"])
    # A'': rows 1-2 transposed between rows 0-1 and row 3: a load would take only its row 2
    d = os.path.join(t, "partial")
    dcp_f32_folder(d, [4, 4], [([0, 0], [2, 4], [4, 1], rows(0, 2)), ([1, 0], [2, 4], [1, 2], transposed(rows(1, 3), 2, 4)),
                               ([3, 0], [1, 4], [4, 1], rows(3, 4))])
    run("permuted_chunks", ["digest", d], 1, ["__0_0.distcp: tensor 'w'", "block [2,4] at [1,0]",
                                              "shares elements with another file's chunk"])
    # [2, 2^22] stored transposed: every window of the digest cuts its stored-innermost dimension
    # (arrays, freed before the run: the tool is forked from this process, whose memory its peak
    # RSS would count)
    import array
    n = 1 << 22
    wide = array.array("f", (float(i % 1000) for i in range(2 * n)))  # row-major [2, n]
    stored = array.array("f", bytes(8 * n))
    stored[0::2], stored[1::2] = wide[:n], wide[n:]  # column j of the rows at 2j, 2j + 1
    want = digest_line([2, n], wide.tobytes())
    d = os.path.join(t, "wide")
    dcp_f32_folder(d, [2, n], [([0, 0], [2, n], [1, 2], stored)])
    del wide, stored
    out, _ = run("permuted_chunks", ["digest", d], 0)
    if out.strip() != want:
        raise Failed("digest of the wide tensor said " + out.strip() + ", Python " + want)


@case
def stacked_experts_count(t):
    """--stack-experts on a [2^62, 0] tensor (a 100-byte file) and on 1.3M experts: refused before allocating."""
    write(os.path.join(t, "a.safetensors"), safetensors_bytes([("m.experts.w", "F32", [2 ** 62, 0], b"")]))
    run("stacked_experts_count", ["to-hf", os.path.join(t, "a.safetensors"), os.path.join(t, "o1"), "--stack-experts",
                                  r"^(.*\.experts)\.(w)$=\1.{i}.\2"], 1, ["experts pass the limit"])
    write(os.path.join(t, "b.safetensors"), safetensors_bytes([("m.experts.w", "U8", [1300000, 1], b"\0" * 1300000)]))
    run("stacked_experts_count", ["to-hf", os.path.join(t, "b.safetensors"), os.path.join(t, "o2"), "--stack-experts",
                                  r"^(.*\.experts)\.(w)$=\1.{i}.\2"], 1, ["experts pass the limit"])


@case
def unshard_claimed_terabytes(t):
    """metadata.json claiming a 1 TiB tensor no file covers: refused before the output is sized."""
    ck = os.path.join(t, "ckpt")
    sharded_checkpoint(ck, [("huge", "F32", [0], b"")])  # rank 1 holds none of its elements
    with open(os.path.join(ck, "metadata.json")) as f:
        md = json.load(f)
    md["tensors"]["huge"] = {"shape": [2 ** 38], "is_sharded": True, "dtype": "F32", "shard_spec_per_file": {
        "rank_1.safetensors": {"flattened_offsets": [[0, 6]], "local_shape": None, "global_offset": None}}}
    md["tensors"]["huge"]["shard_spec_per_file"]["rank_1.safetensors"]["flattened_offsets"] = [[0, 0]]
    write(os.path.join(ck, "metadata.json"), json.dumps(md).encode())
    out = os.path.join(t, "out.safetensors")
    run("unshard_claimed_terabytes", ["unshard", ck, out], 1, ["tensor 'huge'", "in no file"])
    if os.path.exists(out):
        raise Failed("unshard left " + out)
    left = [n for n in os.listdir(t) if ".tmp." in n]
    if left:
        raise Failed("unshard left temporaries: " + ", ".join(left))


@case
def duplicate_json_keys(t):
    """A key given twice (Python's json keeps the last, others the first): refused everywhere."""
    ck = os.path.join(t, "ckpt")
    sharded_checkpoint(ck)
    text = open(os.path.join(ck, "metadata.json")).read()
    write(os.path.join(ck, "metadata.json"),
          text.replace('"dtype": "F32"', '"dtype": "F32", "dtype": "I32"', 1).encode())
    for cmd in ("verify", "digest", "inspect"):
        run("duplicate_json_keys", [cmd, ck], 1, ["dtype", "twice"])
    hf = os.path.join(t, "hf")
    hf_folder(hf, True)
    idx = open(os.path.join(hf, "model.safetensors.index.json")).read()
    write(os.path.join(hf, "model.safetensors.index.json"),
          idx.replace('"weight_map"', '"weight_map": {"a": "model-00002-of-00002.safetensors"}, "weight_map"', 1).encode())
    run("duplicate_json_keys", ["verify", hf], 1, ["weight_map", "twice"])


@case
def optim_pickles(t):
    """verify of a model + optimizer pair whose optim/ pickles run code or break the layout: refused."""
    base = os.path.join(t, "base")
    sharded_checkpoint(os.path.join(base, "model"))

    def optim(d, groups, n=None, extra=None):
        ts = [("num_param_groups", "I64", [], struct.pack("<q", len(groups) if n is None else n))]
        for i, g in enumerate(groups):
            ts.append((f"param_group{i}", "U8", [len(g)], g))
        for k, v in (extra or {}).items():
            ts.append((k, "U8", [len(v)], v))
        write(os.path.join(d, "rank_0.safetensors"), safetensors_bytes(ts))
        md = {"tensors": {name: {"shape": shape, "is_sharded": False, "dtype": dt, "shard_spec_per_file": {
            "rank_0.safetensors": {"flattened_offsets": [[0, max(1, shape[0] if shape else 1)]], "local_shape": None,
                                   "global_offset": None}}} for name, dt, shape, _ in ts}}
        write(os.path.join(d, "metadata.json"), json.dumps(md).encode())
    good = b"\x80\x02}(X\x0c\x00\x00\x00_param_names](X\x01\x00\x00\x00wX\x01\x00\x00\x00beu."
    evil = b"\x80\x02cposix\nsystem\nX\x04\x00\x00\x00true\x85R."
    cases = {"os_system": ([evil], None, ["param_group0", "GLOBAL", "classes and calls are refused"]), "truncated": ([good[:-5]], None, ["param_group0"]),
             "huge_count": ([good], 2 ** 62, ["num_param_groups"]), "missing_group": ([], 1, ["param_group0", "missing"]),
             "deep": ([b"\x80\x02" + b"]" * 100000 + b"."], None, ["param_group0"]),
             # a 1 MB str the memo holds once, in a list 1,000 times: 1 GB as a tree of copies
             "memo_string": ([b"\x80\x02X" + struct.pack("<I", 1 << 20) + b"s" * (1 << 20) + b"q\x000](" + b"h\x00" * 1000 + b"e."],
                             None, ["param_group0", "expands to more than", "strings count 1 per 8 bytes"])}
    ok = os.path.join(t, "ok")
    shutil.copytree(base, ok)
    optim(os.path.join(ok, "optim"), [good])
    run("optim_pickles", ["verify", ok], 0)
    for name, (groups, n, words) in cases.items():
        d = os.path.join(t, name)
        shutil.copytree(base, d)
        optim(os.path.join(d, "optim"), groups, n)
        run("optim_pickles", ["verify", d], 1, words)


@case
def control_bytes(t):
    """Escape sequences and newlines in names and __metadata__ values never reach the terminal."""
    bad = "a\x1b]0;owned\x07\nb"
    write(os.path.join(t, "x.safetensors"), safetensors_bytes([(bad, "F32", [1], struct.pack("<f", 1))],
                                                              {"k\x1b[2J": "v\ny\x07"}))
    out, _ = run("control_bytes", ["inspect", os.path.join(t, "x.safetensors")], 0)
    if any(ord(c) < 0x20 and c != "\n" or ord(c) == 0x7f for c in out) or "owned\x07" in out:
        raise Failed("a control byte reached stdout: " + repr(out))
    if out.count("\n") != 4:  # title, __metadata__ line, header row, one tensor row
        raise Failed("a newline from the input split a line: " + repr(out))
    out, _ = run("control_bytes", ["digest", os.path.join(t, "x.safetensors")], 0)
    if "\x1b" in out or out.count("\n") != 1:
        raise Failed("digest printed a raw control byte: " + repr(out))


@case
def export_drops_everything(t):
    """to-hf --preset dcp-to-hf of keys that are not model.*: an export of nothing is an error."""
    write(os.path.join(t, "x.safetensors"), safetensors_bytes([("optim.state.w", "F32", [1], struct.pack("<f", 1))]))
    run("export_drops_everything", ["to-hf", os.path.join(t, "x.safetensors"), os.path.join(t, "o"), "--preset", "dcp-to-hf"],
        1, ["drop all 1 tensors"])
    if os.path.exists(os.path.join(t, "o", "model.safetensors")):
        raise Failed("an empty model.safetensors was written")


@case
def nul_in_name(t):
    """A name holding a NUL is written \\x00 in messages, not cut there."""
    ck = os.path.join(t, "ckpt")
    sharded_checkpoint(ck)
    with open(os.path.join(ck, "metadata.json")) as f:
        md = json.load(f)
    md["tensors"]["x\u0000tail"] = md["tensors"].pop("b")
    md["tensors"]["x\u0000tail"]["shape"] = [4]
    write(os.path.join(ck, "metadata.json"), json.dumps(md).encode())
    run("nul_in_name", ["verify", ck], 1, ["x\\x00tail"])


@case
def many_rank_files(t):
    """A valid 1,100-rank checkpoint under `ulimit -n 1024` (and 256): one descriptor per file at most."""
    ck = os.path.join(t, "ckpt")
    n = 1100
    specs = {}
    for r in range(n):
        write(os.path.join(ck, f"rank_{r}.safetensors"), safetensors_bytes([("w", "F32", [1], struct.pack("<f", r))]))
        specs[f"rank_{r}.safetensors"] = {"flattened_offsets": [[r, r + 1]], "local_shape": None, "global_offset": None}
    write(os.path.join(ck, "metadata.json"), json.dumps(
        {"tensors": {"w": {"shape": [n], "is_sharded": True, "dtype": "F32", "shard_spec_per_file": specs}}}).encode())
    want = hashlib.sha256(struct.pack(f"<{n}f", *range(n))).hexdigest()
    for nofile in (1024, 256):
        run("many_rank_files", ["verify", ck], 0, nofile=nofile)
        out, _ = run("many_rank_files", ["digest", ck], 0, nofile=nofile)
        if want not in out:
            raise Failed("digest under ulimit -n %d: %s" % (nofile, out))
        run("many_rank_files", ["unshard", ck, os.path.join(t, f"out{nofile}.safetensors")], 0, nofile=nofile)


@case
def many_chunks_one_file(t):
    """A DCP data file holding 1,100 chunks of one tensor, under `ulimit -n 256`: opened once."""
    d = os.path.join(t, "dcp")
    dcp_overlapping(d, 1100)
    run("many_chunks_one_file", ["verify", d], 0, nofile=256)
    run("many_chunks_one_file", ["digest", d], 0, nofile=256)


@case
def column_sharded(t):
    """A [2^24, 2] U8 tensor kept as two column blocks (a copy-plan run per row): verify, digest and
    unshard in bounded memory (plans are made a window of runs at a time), and the right bytes."""
    ck = os.path.join(t, "ckpt")
    rows = 1 << 24
    write(os.path.join(ck, "rank_0.safetensors"), safetensors_bytes([("w", "U8", [rows], bytes(rows))]))
    write(os.path.join(ck, "rank_1.safetensors"), safetensors_bytes([("w", "U8", [rows], b"\x01" * rows)]))
    write(os.path.join(ck, "metadata.json"), json.dumps({"tensors": {"w": {
        "shape": [rows, 2], "is_sharded": True, "dtype": "U8", "shard_spec_per_file": {
            "rank_0.safetensors": {"flattened_offsets": None, "local_shape": [rows, 1], "global_offset": [0, 0]},
            "rank_1.safetensors": {"flattened_offsets": None, "local_shape": [rows, 1], "global_offset": [0, 1]}}}}}).encode())
    want = hashlib.sha256(b"\x00\x01" * rows).hexdigest()  # row-major: column 0 then column 1, each row
    run("column_sharded", ["verify", ck], 0)
    out, _ = run("column_sharded", ["digest", ck], 0)
    if want not in out:
        raise Failed("digest: " + out)
    o = os.path.join(t, "full.safetensors")
    run("column_sharded", ["unshard", ck, o], 0)
    with open(o, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        f.seek(8 + n)
        if hashlib.sha256(f.read()).hexdigest() != want:
            raise Failed("unshard wrote other bytes")


@case
def sparse_nul_documents(t):
    """metadata.json (32 MiB, its limit), an index (16 MiB, its limit) or .metadata (2^30) of NUL bytes (sparse on disk):
    refused at once, in little memory."""
    def sparse(path, size=1 << 30):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.truncate(size)
    ck = os.path.join(t, "ckpt")
    sharded_checkpoint(ck)
    sparse(os.path.join(ck, "metadata.json"), 32 << 20)
    run("sparse_nul_documents", ["verify", ck], 1, ["metadata.json", "not valid JSON"])
    hf = os.path.join(t, "hf")
    hf_folder(hf, True)
    sparse(os.path.join(hf, "model.safetensors.index.json"), 16 << 20)  # its limit
    run("sparse_nul_documents", ["verify", hf], 1, ["model.safetensors.index.json", "not valid JSON"])
    dc = os.path.join(t, "dcp")
    dcp_folder(dc)
    sparse(os.path.join(dc, ".metadata"))
    run("sparse_nul_documents", ["verify", dc], 1, [".metadata", "PROTO"])

def torch_save_pickle(tensors, storages, value=None, legacy=False):
    """A torch.save state dict's pickle without torch: tensors maps a name to (storage, storage
    offset, size, stride[, state]: a BUILD on the tensor), the storage a key or (key, class name)
    for a class other than its entry's; storages a key to (class name, numel, bytes); value,
    when given, is pickled instead of the state dict. Python's pickler makes it, with stand-ins
    that pickle under torch's names. A legacy persistent id has a sixth field, view_metadata:
    None, or the storages entry's fourth field where it has one."""
    import collections
    import pickle
    import types

    torch = types.ModuleType("torch")
    utils = types.ModuleType("torch._utils")
    torch._utils = utils
    saved = {m: sys.modules.get(m) for m in ("torch", "torch._utils")}
    sys.modules["torch"], sys.modules["torch._utils"] = torch, utils
    try:
        def _rebuild_tensor_v2(*a):
            raise AssertionError("never called")
        _rebuild_tensor_v2.__module__ = "torch._utils"
        _rebuild_tensor_v2.__qualname__ = "_rebuild_tensor_v2"
        utils._rebuild_tensor_v2 = _rebuild_tensor_v2
        classes = {}
        names = [v[0] for v in storages.values()] + [v[0][1] for v in tensors.values() if isinstance(v[0], tuple)]
        for cls in names:
            classes[cls] = type(cls, (), {"__module__": "torch"})
            setattr(torch, cls, classes[cls])

        class Storage:
            def __init__(self, key):
                self.key, self.cls = key if isinstance(key, tuple) else (key, None)

        class Tensor:
            def __init__(self, key, offset, size, stride, state=None):
                self.args = (Storage(key), offset, tuple(size), tuple(stride), False, collections.OrderedDict())
                self.state = state

            def __reduce__(self):
                return (_rebuild_tensor_v2, self.args) if self.state is None else (_rebuild_tensor_v2, self.args, self.state)

        class Pickler(pickle.Pickler):
            def persistent_id(self, obj):
                if isinstance(obj, Storage):
                    entry = storages[obj.key]
                    pid = ("storage", classes[obj.cls or entry[0]], obj.key, "cpu", entry[1])
                    return pid + (entry[3] if len(entry) > 3 else None,) if legacy else pid
                return None

        sd = value if value is not None else collections.OrderedDict((n, Tensor(*v)) for n, v in tensors.items())
        buf = io.BytesIO()
        Pickler(buf, protocol=2).dump(sd)
        return buf.getvalue()
    finally:
        for m, v in saved.items():
            if v is None:
                sys.modules.pop(m, None)
            else:
                sys.modules[m] = v


def torch_save_bytes(tensors, storages, prefix="archive", value=None):
    """A torch.save zip (stored records, as torch writes them) of torch_save_pickle's pickle;
    a storage whose bytes are None is left out of the archive."""
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr(prefix + "/data.pkl", torch_save_pickle(tensors, storages, value))
        for key, entry in storages.items():
            if entry[2] is not None:  # None: a storage the pickle names and the archive lacks
                z.writestr(prefix + "/data/" + key, entry[2])
        z.writestr(prefix + "/version", b"3\n")
    return out.getvalue()


def torch_save_legacy_bytes(tensors, storages, keys=None, sizes=None):
    """A torch.save file in the legacy format (torch < 1.6) of torch_save_pickle's legacy pickle:
    the magic number, protocol version and sys_info pickles, the state dict, the storage keys
    (keys, else the storages' sorted), then each listed storage's int64 size (sizes[key], else
    its numel) and bytes."""
    import pickle

    keys = sorted(storages) if keys is None else keys
    out = io.BytesIO()
    for v in (0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001, "little_endian": True,
                                               "type_sizes": {"short": 2, "int": 4, "long": 8}}):
        pickle.dump(v, out, protocol=2)
    out.write(torch_save_pickle(tensors, storages, legacy=True))
    pickle.dump(keys, out, protocol=2)
    for k in keys:
        out.write(struct.pack("<q", (sizes or {}).get(k, storages[k][1])) + storages[k][2])
    return out.getvalue()


@case
def torch_save_files(t):
    """pytorch_model.bin folders: 65,536 tensors over one shared storage (the most a file holds:
    listed, digested and
    converted in bounded time and memory), a tensor claiming 2^80 elements of a 4-byte storage,
    a slice past its storage's end, a storage the archive lacks, a BUILD on a tensor (torch would
    move it to other bytes), a 1 MiB key over 200,000 values (200 GB of flattened names): exit 1
    naming each."""
    d = os.path.join(t, "many")
    os.makedirs(d)
    n = 1 << 16  # max_torch_save_tensors: about 1.5 KiB of memory each (the pickle's values, the index)
    write(os.path.join(d, "pytorch_model.bin"),
          torch_save_bytes({f"layers.{i}.w": ("0", i % 4, (1,), (1,)) for i in range(n)},
                           {"0": ("FloatStorage", 4, struct.pack("<4f", 1, 2, 3, 4))}))
    out, _ = run("torch_save_files", ["inspect", d], 0)
    if out.count("\n") != n + 2:
        raise Failed(f"inspect listed {out.count(chr(10)) - 2} tensors, not {n}")
    run("torch_save_files", ["digest", d], 0)
    run("torch_save_files", ["to-hf", d, os.path.join(t, "many-hf")], 0)
    four = {"0": ("FloatStorage", 1, b"\0\0\x80\x3f"), "7": ("FloatStorage", 1, None)}
    for name, tensors, words in (
            ("huge", {"w": ("0", 0, (1 << 40, 1 << 40), (1 << 40, 1))}, ["tensor 'w'", "overflows"]),
            ("past", {"w": ("0", 1, (1,), (1,))}, ["tensor 'w'", "pass the end of its storage"]),
            ("lost", {"w": ("7", 0, (1,), (1,))}, ["tensor 'w'", "storage '7' has no record"]),
            ("moved", {"w": ("0", 0, (1,), (1,), ({}, 0, (1,), (1,)))}, ["BUILD", "not a state dict"])):
        d = os.path.join(t, name)
        os.makedirs(d)
        write(os.path.join(d, "pytorch_model.bin"), torch_save_bytes(tensors, four))
        run("torch_save_files", ["inspect", d], 1, ["pytorch_model.bin"] + words)
    d = os.path.join(t, "names")
    os.makedirs(d)
    write(os.path.join(d, "pytorch_model.bin"), torch_save_bytes({}, four, value={"k" * (1 << 20): {i: None for i in range(200000)}}))
    run("torch_save_files", ["inspect", d], 1, ["pytorch_model.bin", "flattened names pass"])


@case
def torch_save_legacy(t):
    """pytorch_model.bin in torch.save's legacy format: 65,536 tensors over one storage (a 10 MiB
    pickle, read through growing windows of the file's head: listed, digested and converted in
    bounded time and memory); a 100 MiB file whose pickle never ends (a string of 4 GiB): refused
    after 64 MiB; a storage whose size in the file is not its pickle's, one of 2^62 elements, one
    listed twice, one the pickle never names, a tensor whose storage is not listed, a storage
    view, two types over one storage: exit 1 naming each."""
    d = os.path.join(t, "many")
    os.makedirs(d)
    n = 1 << 16  # max_torch_save_tensors
    one = {"0": ("FloatStorage", 4, struct.pack("<4f", 1, 2, 3, 4))}
    write(os.path.join(d, "pytorch_model.bin"),
          torch_save_legacy_bytes({f"layers.{i}.w": ("0", i % 4, (1,), (1,)) for i in range(n)}, one))
    out, _ = run("torch_save_legacy", ["inspect", d], 0)
    if out.count("\n") != n + 2:
        raise Failed(f"inspect listed {out.count(chr(10)) - 2} tensors, not {n}")
    out, _ = run("torch_save_legacy", ["digest", d], 0)
    want = {f"layers.{i}.w F32 [1] " + hashlib.sha256(struct.pack("<f", i % 4 + 1)).hexdigest() for i in range(n)}
    if set(out.splitlines()) != want:
        raise Failed("digest gave other bytes than the storage's")
    run("torch_save_legacy", ["to-hf", d, os.path.join(t, "many-hf")], 0)
    d = os.path.join(t, "endless")
    os.makedirs(d)
    head = torch_save_legacy_bytes({}, {})
    head = head[:head.index(b"\x80\x02", 21 + 1)]  # magic, version and sys_info
    with open(os.path.join(d, "pytorch_model.bin"), "wb") as f:
        f.write(head + b"\x80\x02X\xf0\xff\xff\xff")
        f.truncate(100 << 20)
    run("torch_save_legacy", ["inspect", d], 1, ["pytorch_model.bin", "pickles run past the first 67108864 bytes"])
    f32 = {"0": ("FloatStorage", 2, b"\0" * 8), "1": ("FloatStorage", 1, b"\0" * 4)}
    w = {"w": ("0", 0, (2,), (1,)), "v": ("1", 0, (1,), (1,))}
    for name, data, words in (
            ("size", torch_save_legacy_bytes(w, f32, sizes={"1": 2}), ["storage '1'", "the file says 2 elements", "its persistent id says 1"]),
            ("huge", torch_save_legacy_bytes({"w": ("0", 0, (1,), (1,))}, {"0": ("FloatStorage", 1 << 62, b"")}),
             ["storage '0'", "4611686018427387904 elements", "past the file's end"]),
            ("twice", torch_save_legacy_bytes(w, f32, keys=["0", "1", "1"]), ["storage '1' is listed twice"]),
            ("unnamed", torch_save_legacy_bytes({"w": w["w"]}, f32), ["storage '1'", "named nowhere in the pickle"]),
            ("unlisted", torch_save_legacy_bytes(w, f32, keys=["0"]), ["tensor 'v'", "storage '1' is not in the file's storage list"]),
            ("view", torch_save_legacy_bytes(w, {**f32, "1": f32["1"] + (("2", 0, 1),)}), ["BINPERSID", "view into another storage"]),
            ("types", torch_save_legacy_bytes({**w, "i": (("0", "IntStorage"), 0, (2,), (1,))}, f32),
             ["BINPERSID at byte", "names storage '0' as 2 of torch.IntStorage", "as 2 of torch.FloatStorage"])):
        d = os.path.join(t, name)
        os.makedirs(d)
        write(os.path.join(d, "pytorch_model.bin"), data)
        run("torch_save_legacy", ["inspect", d], 1, ["pytorch_model.bin"] + words)


def pickled_tensor(key, numel, cls=b"FloatStorage", fn=b"_rebuild_tensor_v2", extra=b""):
    """Protocol-2 opcodes of torch._utils.<fn>(storage KEY of numel elements, 0, (numel,), (1,),
    False, OrderedDict()<, extra arguments>), as torch pickles a tensor (zip format's persistent id)."""
    return (b"ctorch._utils\n" + fn + b"\n(" +
            b"(X\x07\x00\x00\x00storagectorch\n" + cls + b"\nX" + struct.pack("<I", len(key)) + key +
            b"X\x03\x00\x00\x00cpuK" + bytes([numel]) + b"tQ" +
            b"K\x00K" + bytes([numel]) + b"\x85K\x01\x85\x89ccollections\nOrderedDict\n)R" + extra + b"tR")


def torch_zip_of(pkl, records):
    """A torch.save zip of data.pkl `pkl` (opcodes between PROTO 2 and STOP) and records {name: bytes} under archive/."""
    import zipfile
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", b"\x80\x02" + pkl + b".")
        if "version" not in records:
            z.writestr("archive/version", b"3\n")
        for name, data in records.items():
            z.writestr("archive/" + name, data)
    return out.getvalue()


@case
def torch_save_applied(t):
    """torch.save files in which torch.load would change a tensor after making it, or read other
    bytes than the stream shardsafe reads: SETITEM on a tensor (its __setitem__), conj metadata
    (torch 2.x), a Parameter's state, records named alike but for case, a popped persistent id
    whose record is missing, a legacy magic number in a 100-byte FRAME, a legacy state dict whose
    FRAME runs past its STOP, a legacy file whose first 512 bytes pass tarfile's checksum: exit 1
    naming each; the same file without the change is read."""
    four = {"data/0": struct.pack("<4f", 1, 2, 3, 4)}
    w = b"X\x01\x00\x00\x00w"
    sd = lambda body: b"}(" + body + b"u"  # noqa: E731  a dict of the pairs in body
    ok = os.path.join(t, "ok")
    os.makedirs(ok)
    write(os.path.join(ok, "pytorch_model.bin"), torch_zip_of(sd(w + pickled_tensor(b"0", 4)), four))
    out, _ = run("torch_save_applied", ["digest", ok], 0)
    if out != "w F32 [4] " + hashlib.sha256(four["data/0"]).hexdigest() + "\n":
        raise Failed(f"digest of the plain file: {out!r}")
    popped = b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x009X\x03\x00\x00\x00cpuK\x01tQ0"
    cases = [
        ("setitem", torch_zip_of(sd(w + pickled_tensor(b"0", 4) + b"2K\x00G" + struct.pack(">d", 100.0) + b"s"), four),
         ["SETITEM on a tensor", "__setitem__"]),
        ("conj", torch_zip_of(sd(w + pickled_tensor(b"0", 4, extra=b"}X\x04\x00\x00\x00conj\x88s")), four),
         ["_rebuild_tensor_v2", "metadata that is not empty"]),
        ("state", torch_zip_of(sd(w + b"ctorch._utils\n_rebuild_parameter_with_state\n(" + pickled_tensor(b"0", 4) +
                                  b"\x89ccollections\nOrderedDict\n)R}X\x01\x00\x00\x00xK\x01stR"), four),
         ["_rebuild_parameter_with_state", "a state that is not empty"]),
        ("case", torch_zip_of(sd(w + pickled_tensor(b"a", 4)), {"data/a": four["data/0"], "data/A": four["data/0"]}),
         ["two records named", "alike, but for case"]),
        ("popped", torch_zip_of(popped + sd(w + pickled_tensor(b"0", 4)), four), ["storage '9'", "no record 'archive/data/9'"]),
    ]
    # legacy files: the magic number in a FRAME of 100 bytes; a state dict in a FRAME reaching
    # past its STOP; a tar header's checksum over the first 512 bytes
    f32 = {"0": ("FloatStorage", 4, four["data/0"])}
    legacy = torch_save_legacy_bytes({"w": ("0", 0, (4,), (1,))}, f32)
    framed = b"\x80\x04\x95" + struct.pack("<Q", 100) + legacy[2:]
    cases.append(("magic_frame", framed, ["magic number's pickle lies in a FRAME of 100 bytes"]))
    main_at = legacy.index(b"\x80\x02", 21 + 1)  # after magic, version, sys_info
    keys_at = legacy.index(b"\x80\x02", main_at + 2)
    body = legacy[main_at + 2:keys_at]  # the state dict's opcodes through STOP
    past = legacy[:main_at] + b"\x80\x04\x95" + struct.pack("<Q", len(body) + 8) + body + legacy[keys_at:]
    cases.append(("frame_past_stop", past, ["STOP at byte", "inside a FRAME"]))
    import pickle
    info = pickle.dumps({"protocol_version": 1001, "little_endian": True, "pad": "a" * 600}, protocol=2)
    tar = bytearray(legacy[:21] + info + legacy[legacy.index(b"\x80\x02", 21 + 1):])
    tar[148:156] = b" " * 8
    tar[148:156] = b"%06o\0 " % sum(tar[:512])
    cases.append(("tar", bytes(tar), ["first 512 bytes are also a tar header"]))
    for name, data, words in cases:
        d = os.path.join(t, name)
        os.makedirs(d)
        write(os.path.join(d, "pytorch_model.bin"), data)
        run("torch_save_applied", ["inspect", d], 1, ["pytorch_model.bin"] + words)


@case
def torch_save_values(t):
    """A training checkpoint's values that are not tensors, read from a .pt file of its own: a
    4 MiB str held 17 times by a list through the memo, beside 8 MB of other str (68 MiB written
    out without a memo: listed,
    left out by to-hf, refused by to-dcp unless renamed away), a list doubled 60 times through
    the memo (refused by the pickle's bound), a storage class as a value (refused by to-dcp),
    100,000 values in a list of dicts (listed), two values flattened to one name, a tuple key, a
    dict of keys 1 and True (one key to Python) (refused): each named, in bounded time and memory."""
    doubled = [1]
    for _ in range(60):
        doubled = [doubled, doubled]
    big = "s" * (4 << 20)
    pad = ["%07d" % i + "p" * 993 for i in range(8000)]  # 8 MB of distinct str: a pickle large enough to hold x
    files = {"repeated": torch_save_bytes({}, {}, value={"epoch": 3, "x": [big] * 17, "pad": pad}),
             "doubled": torch_save_bytes({}, {}, value={"x": doubled}),
             "storage_class": torch_zip_of(b"}(X\x01\x00\x00\x00yctorch\nFloatStorage\nu", {}),
             "many": torch_save_bytes({}, {}, value={"v": [{"k": i} for i in range(100000)]}),
             "twice": torch_save_bytes({}, {}, value={"a.b": 1, "a": {"b": 2}}),
             "tuple_key": torch_save_bytes({}, {}, value={"k": {(1, 2): 3}}),
             "big_tuple_key": torch_save_bytes({}, {}, value={"k": {tuple(range(40)): 3}}),
             # {1: 1, True: 2}, which Python's pickler cannot write (the dict has one entry)
             "equal_keys": torch_zip_of(b"}(X\x01\x00\x00\x00k}(K\x01K\x01\x88K\x02uu", {})}
    for name, data in files.items():
        write(os.path.join(t, name + ".pt"), data)
    pt = lambda name: os.path.join(t, name + ".pt")  # noqa: E731
    out, _ = run("torch_save_values", ["inspect", pt("repeated")], 0)
    if "value: ['sssss" not in out or "value: 3" not in out:
        raise Failed(f"inspect of the repeated str: {out!r}")
    out, _ = run("torch_save_values", ["to-hf", pt("repeated"), os.path.join(t, "repeated-hf")], 0)
    if "3 non-tensor item(s) left out" not in out:
        raise Failed(f"to-hf of the repeated str: {out!r}")
    run("torch_save_values", ["to-dcp", pt("repeated"), os.path.join(t, "repeated-dcp")], 1,
        ["repeated.pt", "value 'x'", "without a memo"])
    out, _ = run("torch_save_values", ["to-dcp", pt("repeated"), os.path.join(t, "renamed-dcp"), "--rename", "^x$="], 0)
    if "0 tensors and 2 non-tensor items" not in out:
        raise Failed(f"to-dcp of the repeated str, x renamed away: {out!r}")
    run("torch_save_values", ["inspect", pt("doubled")], 1, ["doubled.pt", "expands to more than"])
    run("torch_save_values", ["to-dcp", pt("storage_class"), os.path.join(t, "storage-dcp")], 1,
        ["storage_class.pt", "value 'y'", "holds a storage or a torch global"])
    out, _ = run("torch_save_values", ["inspect", pt("many")], 0)
    if out.count("  value: ") != 100000:
        raise Failed(f"inspect listed {out.count('  value: ')} values, not 100000")
    run("torch_save_values", ["inspect", pt("twice")], 1, ["twice.pt", "'a.b'", "given twice"])
    # a small tuple of plain values is a key (Megatron's distrib_optim.pt), named as Python's str()
    out, _ = run("torch_save_values", ["inspect", pt("tuple_key")], 0)
    if "k.(1, 2)" not in out:
        raise Failed("inspect of a {(1, 2): 3} dict does not list 'k.(1, 2)'")
    run("torch_save_values", ["inspect", pt("big_tuple_key")], 1, ["big_tuple_key.pt", "'k' has a key of type tuple"])
    run("torch_save_values", ["inspect", pt("equal_keys")], 1, ["equal_keys.pt", "'k' has two keys Python holds equal", "'True'"])


ALL_COMMANDS = ("inspect", "verify", "digest", "unshard", "to-hf", "to-dcp")


def command_argv(cmd, src, outs):
    """The arguments of `shardsafe cmd` reading src, its output (if any) under outs."""
    if cmd == "unshard":
        return [cmd, src, os.path.join(outs, "u.safetensors")]
    if cmd in ("to-hf", "to-dcp"):
        return [cmd, src, os.path.join(outs, cmd)]
    return [cmd, src]


def refused_by_all(name, src, outs, words, commands=ALL_COMMANDS):
    """Each of `commands` exits 1 on src with `words` in its message, and writes no file under outs."""
    for cmd in commands:
        run(name, command_argv(cmd, src, outs), 1, words)
        wrote = [os.path.join(d, f) for d, _, fs in os.walk(outs) for f in fs]
        if wrote:  # an empty output folder made before the input's rank files were opened is no output
            raise Failed(f"{cmd} refused {src} but wrote {wrote}")


def load_case_files():
    """Cases kept in files of their own beside this one (cases_*.py, by subject), run with this
    file's helpers in scope (run, case, the writers above): their @case adds them to CASES."""
    import glob
    import importlib.util
    shared = {k: v for k, v in globals().items() if not k.startswith("__")}
    for path in sorted(glob.glob(os.path.join(HERE, "cases_*.py"))):
        spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
        mod = importlib.util.module_from_spec(spec)
        mod.__dict__.update(shared)
        spec.loader.exec_module(mod)


load_case_files()


def main(argv):
    global TOOL
    TOOL = argv[1]
    # meson test sets MALLOC_PERTURB_, which makes glibc fill every allocation: memory a parser
    # reserves but never touches (simdjson sizes its buffers for the whole document) would count
    # as resident. The limits are about what a user's process holds, so the tool runs without it.
    os.environ.pop("MALLOC_PERTURB_", None)
    if "--list" in argv:
        print("\n".join(CASES))
        return 0
    names = [a for a in argv[2:] if not a.startswith("-")] or list(CASES)
    failed = []
    for n in names:
        with tempfile.TemporaryDirectory(prefix="shardsafe-hostile-") as t:
            try:
                CASES[n](t)
                print(f"ok      {n}")
            except Failed as e:
                failed.append(n)
                print(f"FAILED  {n}: {e}")
    print(f"\n{'case':24} {'command':52} {'exit':>4} {'CPU s':>7} {'MiB':>7} {'wall s':>7}")
    for c, cmd, code, secs, mib, wall in RESULTS:
        print(f"{c:24} {cmd:52} {code:4d} {secs:7.2f} {mib:7.1f} {wall:7.2f}")
    worst_s = max((r[3] for r in RESULTS), default=0)
    worst_m = max((r[4] for r in RESULTS), default=0)
    print(f"\n{len(RESULTS)} commands in {len(names)} cases; slowest {worst_s:.2f} CPU s, largest {worst_m:.1f} MiB "
          f"(limits {LIMIT_S:.0f} CPU s, {LIMIT_MIB:.0f} MiB); {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
