"""safetensors headers at and past their limits (issue 53; docs/FORMAT.md §1): a header of up to
100,000,000 bytes and up to 65,536 tensors per file. Valid files at the limits are read by every
command within LIMIT_MIB and LIMIT_S; past a limit they are refused naming the file and the rule,
at a small fixed cost. Before, the reader held the header's text and a DOM of it (a 100 MB
header of two million tensors: 1.2 GiB for inspect, 3.8 GiB for to-dcp), and the index of each
of a checkpoint's rank files, hard links of one file among them.

The headers are written with plain string joins, the data as sparse zeros where its values do
not matter. Loaded by hostile.py with its helpers in scope (run, case, write, Failed, ...).

Left out of the default run (open_case: SHARDSAFE_HOSTILE_OPEN=1 runs it): to-hf, to-dcp and
unshard of a file whose 65,536 names fill a 100 MB header; their planners hold about a dozen
copies of every name (1.4 GiB measured), which is the exports' matter, not the header's."""
import hashlib
import json
import os
import shutil
import struct

_CAP = 1 << 16  # max_tensors_per_file
_MAX_HEADER = 100_000_000
_ALL = ("inspect", "verify", "digest", "unshard", "to-hf", "to-dcp")
_ONE_FILE = ("inspect", "verify", "digest", "to-hf", "to-dcp")  # unshard reads folders


def open_case(fn):
    """A case of a limit still open (the module's docstring): registered with
    SHARDSAFE_HOSTILE_OPEN=1 only."""
    return case(fn) if os.environ.get("SHARDSAFE_HOSTILE_OPEN") == "1" else fn


def _entry(name, i):
    return '"%s":{"dtype":"U8","shape":[1],"data_offsets":[%d,%d]}' % (name, i, i + 1)


def _st(path, names, data=None, header_size=None):
    """A safetensors file of one-byte U8 tensors `names` (in data order; a list, or (count,
    name_of)), its header padded with spaces to header_size (default: to a multiple of 8);
    data: the bytes, or None for zeros (a sparse file). Built in a child process, so that the
    strings of a 100 MB header never count in the tool's peak RSS (a child forked by `run`
    starts with this process's pages). Returns the header's length."""
    count, name_of = (len(names), names.__getitem__) if isinstance(names, list) else names
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            h = ("{" + ",".join(_entry(name_of(i), i) for i in range(count)) + "}").encode()
            size = header_size if header_size is not None else len(h) + (-len(h)) % 8
            if len(h) <= size:
                h += b" " * (size - len(h))
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(struct.pack("<Q", len(h)) + h)
                    if data is None:
                        f.truncate(8 + len(h) + count)
                    else:
                        f.write(data)
                os.write(w, b"%d" % len(h))
                code = 0
        finally:
            os._exit(code)
    os.close(w)
    got = os.read(r, 64)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise Failed(f"could not build {path}: the entries pass header_size {header_size}")
    return int(got)


def _long_names(k, header_size, tag="n"):
    """(k, name_of): k distinct names of one length, so that k entries fill a header of
    header_size bytes."""
    fixed = len("{}") + (k - 1) + sum(len(_entry("", i)) for i in range(k))
    per = (header_size - fixed) // k
    return k, lambda i: tag * (per - 8) + "%08d" % i


def _argv(cmd, src, outs):
    if cmd == "unshard":
        return [cmd, src, os.path.join(outs, "u.safetensors")]
    if cmd in ("to-hf", "to-dcp"):
        return [cmd, src, os.path.join(outs, cmd)]
    return [cmd, src]


def _refused_by_all(name, src, outs, words, commands=_ALL):
    for cmd in commands:
        run(name, _argv(cmd, src, outs), 1, words)
        if os.path.exists(outs) and os.listdir(outs):
            raise Failed(f"{cmd} refused {src} but wrote {os.listdir(outs)}")


def _hf_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), 8 + n


@case
def header_tensors_at_cap(t):
    """A file of 65,536 one-byte tensors (the most a file may hold) read by every command, the
    output of to-hf checked against the input (names, offsets in name order, bytes); one more
    tensor is refused by every command, naming the file and the rule (the old tool read it)."""
    names = ["t%05d" % i for i in range(_CAP)]
    order = sorted(range(_CAP), key=lambda i: names[i], reverse=True)  # data order != name order
    data = bytes((i * 7 + 1) % 251 for i in range(_CAP))
    hf = os.path.join(t, "hf")
    src = os.path.join(hf, "model.safetensors")
    _st(src, [names[i] for i in order], bytes(data[i] for i in order))
    outs = os.path.join(t, "out")
    os.makedirs(outs)
    out, _ = run("header_tensors_at_cap", ["inspect", src], 0)
    if "%d tensors" % _CAP not in out:
        raise Failed("inspect: " + out[:200])
    run("header_tensors_at_cap", ["verify", src], 0)
    out, _ = run("header_tensors_at_cap", ["digest", src], 0)
    lines = out.splitlines()
    want0 = "t00000 U8 [1] " + hashlib.sha256(data[:1]).hexdigest()
    if len(lines) != _CAP or lines[0] != want0:
        raise Failed(f"digest: {len(lines)} lines, first {lines[:1]}, expected {want0!r}")
    for cmd in ("unshard", "to-dcp"):
        run("header_tensors_at_cap", _argv(cmd, hf, outs), 0)
    run("header_tensors_at_cap", ["to-hf", src, os.path.join(outs, "to-hf")], 0)
    got, start = _hf_header(os.path.join(outs, "to-hf", "model.safetensors"))
    want = {n: {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]} for i, n in enumerate(sorted(names))}
    got.pop("__metadata__", None)
    if got != want:
        raise Failed("to-hf's header differs from the tensors in name order")
    with open(os.path.join(outs, "to-hf", "model.safetensors"), "rb") as f:
        f.seek(start)
        if f.read() != data:  # names[i] holds data[i]; in name order that is data itself
            raise Failed("to-hf's data differs from the input's")
    shutil.rmtree(outs)
    os.makedirs(outs)
    over = os.path.join(t, "over", "model.safetensors")
    _st(over, names + ["u"])
    del out, lines
    _refused_by_all("header_tensors_at_cap", over, outs, ["model.safetensors", "more than 65536 tensors"], _ONE_FILE)
    _refused_by_all("header_tensors_at_cap", os.path.dirname(over), outs, ["model.safetensors", "more than 65536 tensors"])


@case
def header_100mb_names(t):
    """A header of exactly 100,000,000 bytes (the limit), 65,536 tensors whose names fill it:
    inspect, verify and digest within the limits (the old tool: about 1 GiB)."""
    names = _long_names(_CAP, _MAX_HEADER)
    src = os.path.join(t, "big.safetensors")
    if _st(src, names, header_size=_MAX_HEADER) != _MAX_HEADER:
        raise Failed("the header is not 100,000,000 bytes")
    out, _ = run("header_100mb_names", ["inspect", src], 0)
    if "%d tensors" % _CAP not in out or "header %d bytes" % _MAX_HEADER not in out:
        raise Failed("inspect: " + out[:200])
    run("header_100mb_names", ["verify", src], 0)
    out, _ = run("header_100mb_names", ["digest", src], 0)
    zero = hashlib.sha256(b"\0").hexdigest()
    if out.count("\n") != _CAP or out.count(zero) != _CAP or not out.startswith(names[1](0) + " U8 [1] "):
        raise Failed("digest: " + out[:200])


@open_case
def header_100mb_names_export(t):
    """to-hf, to-dcp and unshard of header_100mb_names's file (left out: the module's docstring)."""
    names = _long_names(_CAP, _MAX_HEADER)
    hf = os.path.join(t, "hf")
    _st(os.path.join(hf, "model.safetensors"), names, header_size=_MAX_HEADER)
    outs = os.path.join(t, "out")
    os.makedirs(outs)
    for cmd in ("unshard", "to-hf", "to-dcp"):
        run("header_100mb_names_export", _argv(cmd, hf, outs), 0)


@case
def header_many_tensors_refused(t):
    """A valid-JSON header of 100 MB listing 1.45 million one-byte tensors (the old tool read it
    in 1.2 GiB, to-dcp in 3.8 GiB), alone and as a Hugging Face folder's shard: every command
    refuses it at the 65,537th tensor, naming file and rule, in little memory."""
    k = 1_400_000  # 97 MB of entries
    src = os.path.join(t, "hf", "model.safetensors")
    _st(src, (k, lambda i: "t%07d" % i), header_size=_MAX_HEADER)
    outs = os.path.join(t, "out")
    os.makedirs(outs)
    words = ["model.safetensors", "more than 65536 tensors"]
    _refused_by_all("header_many_tensors_refused", src, outs, words, _ONE_FILE)
    _refused_by_all("header_many_tensors_refused", os.path.dirname(src), outs, words)


@case
def header_deep_nesting(t):
    """A tensor entry whose ignored field nests 49,999,900 arrays: refused as the 1,025th level is
    read (simdjson's depth limit, which the whole-text parse applied after indexing the text:
    the old tool took about 1 GiB), naming the file."""
    depth = 49_999_900
    src = os.path.join(t, "deep.safetensors")
    head = b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":'
    with open(src, "wb") as f:
        f.write(struct.pack("<Q", len(head) + 2 * depth + 2) + head)
        for c in (b"[", b"]"):
            for _ in range(depth // 1_000_000):
                f.write(c * 1_000_000)
            f.write(c * (depth % 1_000_000))
        f.write(b"}}\0")
    for cmd in ("inspect", "verify", "digest"):
        run("header_deep_nesting", [cmd, src], 1, ["deep.safetensors", "not valid JSON"])


@case
def header_hard_links(t):
    """A sharded checkpoint whose 8 rank files are hard links of one file of 65,536 tensors and a
    20 MB header (each rank holds one element of `t00000000`; the rest are listed by no one):
    every command within the limits (the old tool: 484 to 690 MiB), unshard's output checked."""
    ck = os.path.join(t, "ck")
    names = _long_names(_CAP, 20_000_000, tag="r")
    data = bytes((i * 13 + 5) % 256 for i in range(_CAP))
    _st(os.path.join(ck, "rank_0.safetensors"), names, data)
    for r in range(1, 8):
        os.link(os.path.join(ck, "rank_0.safetensors"), os.path.join(ck, "rank_%d.safetensors" % r))
    specs = {"rank_%d.safetensors" % r: {"flattened_offsets": [[r, r + 1]], "local_shape": None, "global_offset": None}
             for r in range(8)}
    write(os.path.join(ck, "metadata.json"), json.dumps(
        {"tensors": {names[1](0): {"shape": [8], "is_sharded": True, "dtype": "U8", "shard_spec_per_file": specs}}}).encode())
    outs = os.path.join(t, "out")
    os.makedirs(outs)
    for cmd in _ALL:
        run("header_hard_links", _argv(cmd, ck, outs), 0)
    got, start = _hf_header(os.path.join(outs, "u.safetensors"))
    got.pop("__metadata__", None)
    if got != {names[1](0): {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}}:
        raise Failed("unshard wrote " + json.dumps(got)[:200])
    with open(os.path.join(outs, "u.safetensors"), "rb") as f:
        f.seek(start)
        if f.read() != data[:1] * 8:  # every rank's element is byte 0 of the one file
            raise Failed("unshard's data differs")
