"""safetensors headers at and past their limits (issue 53; docs/FORMAT.md §1): a header of up to
100,000,000 bytes and up to 65,536 tensors per file. Valid files at the limits are read by every
command within LIMIT_MIB and LIMIT_S; past a limit they are refused naming the file and the rule,
at a small fixed cost. Before, the reader held the header's text and a DOM of it (a 100 MB
header of two million tensors: 1.2 GiB for inspect, 3.8 GiB for to-dcp), and the index of each
of a checkpoint's rank files, hard links of one file among them.

The headers are written with plain string joins, the data as sparse zeros where its values do
not matter. Loaded by hostile.py with its helpers in scope (run, case, write, Failed, ...).

Since: at most 4 MiB of names in one file (65,536 names filling 100 MB took to-hf 1.4 GiB,
to-dcp 0.9 GiB) and 16 MiB of JSON text in one member of the header (a 99 MB __metadata__ value
took inspect 420 MiB, the other commands 300 MiB): a header of 100,000,000 bytes at every cap is
read by every command within the limits."""
import hashlib
import json
import os
import shutil
import struct

_CAP = 1 << 16  # max_tensors_per_file
_MAX_HEADER = 100_000_000
_NAMES = 4 << 20  # max_tensor_name_bytes_per_file
_MEMBER = 16 << 20  # max_header_member_bytes
_ALL = ALL_COMMANDS  # noqa: F821 (hostile.py's)
_ONE_FILE = ("inspect", "verify", "digest", "to-hf", "to-dcp")  # unshard reads folders


def open_case(fn):
    """A case of a limit still open (the module's docstring): registered with
    SHARDSAFE_HOSTILE_OPEN=1 only."""
    return case(fn) if os.environ.get("SHARDSAFE_HOSTILE_OPEN") == "1" else fn


def _entry(name, i):
    return '"%s":{"dtype":"U8","shape":[1],"data_offsets":[%d,%d]}' % (name, i, i + 1)


def _st(path, names, data=None, header_size=None, metadata_bytes=0):
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
            md = ""
            if metadata_bytes:  # a __metadata__ member of exactly metadata_bytes bytes of JSON text
                fixed = len('"__metadata__":{"format":"pt","k":""}')
                md = '"__metadata__":{"format":"pt","k":"%s"},' % ("m" * (metadata_bytes - fixed))
            h = ("{" + md + ",".join(_entry(name_of(i), i) for i in range(count)) + "}").encode()
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
        run("header_tensors_at_cap", command_argv(cmd, hf, outs), 0)
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
    refused_by_all("header_tensors_at_cap", over, outs, ["model.safetensors", "more than 65536 tensors"], _ONE_FILE)
    refused_by_all("header_tensors_at_cap", os.path.dirname(over), outs, ["model.safetensors", "more than 65536 tensors"])


def _names_of_bytes(k, total, tag="n"):
    """(k, name_of): k distinct names whose lengths add up to exactly `total` bytes."""
    per, extra = divmod(total, k)
    return k, lambda i: tag * (per + (i < extra) - 8) + "%08d" % i


@case
def header_at_caps(t):
    """A header of exactly 100,000,000 bytes at every cap: 65,536 tensors whose names take 4 MiB,
    a __metadata__ member of 16 MiB, spaces after: every command within the limits (the old tool
    held the text and a DOM of it: about 1 GiB), digest's and to-hf's outputs checked. Then one
    name byte more, and one __metadata__ byte more: refused by every command, naming the rule."""
    names = _names_of_bytes(_CAP, _NAMES)
    hf = os.path.join(t, "hf")
    src = os.path.join(hf, "model.safetensors")
    if _st(src, names, header_size=_MAX_HEADER, metadata_bytes=_MEMBER) != _MAX_HEADER:
        raise Failed("the header is not 100,000,000 bytes")
    out, _ = run("header_at_caps", ["inspect", src], 0)
    if "%d tensors" % _CAP not in out or "header %d bytes" % _MAX_HEADER not in out:
        raise Failed("inspect: " + out[:200])
    del out
    run("header_at_caps", ["verify", src], 0)
    out, _ = run("header_at_caps", ["digest", src], 0)
    zero = hashlib.sha256(b"\0").hexdigest()
    if out.count("\n") != _CAP or out.count(zero) != _CAP or not out.startswith(names[1](0) + " U8 [1] "):
        raise Failed("digest: " + out[:200])
    del out
    outs = os.path.join(t, "out")
    os.makedirs(outs)
    for cmd in ("unshard", "to-hf", "to-dcp"):
        run("header_at_caps", command_argv(cmd, hf, outs), 0)
    got, start = _hf_header(os.path.join(outs, "to-hf", "model.safetensors"))
    got.pop("__metadata__", None)
    if len(got) != _CAP or sum(map(len, got)) != _NAMES or any(
            got[n] != {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]}
            for i, n in enumerate(sorted(got))):
        raise Failed("to-hf's header is not the 65,536 tensors in name order")
    del got
    shutil.rmtree(outs)
    os.makedirs(outs)
    for what, kw, words in (("names", dict(names=_names_of_bytes(_CAP, _NAMES + 1)), ["names", "4194304 bytes"]),
                            ("metadata", dict(names=names, metadata_bytes=_MEMBER + 1), ["__metadata__", "16777216 bytes"])):
        over = os.path.join(t, "over_" + what, "model.safetensors")
        _st(over, kw["names"], header_size=_MAX_HEADER, metadata_bytes=kw.get("metadata_bytes", 0))
        refused_by_all("header_at_caps", over, outs, ["model.safetensors"] + words, _ONE_FILE)
        refused_by_all("header_at_caps", os.path.dirname(over), outs, ["model.safetensors"] + words)


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
    refused_by_all("header_many_tensors_refused", src, outs, words, _ONE_FILE)
    refused_by_all("header_many_tensors_refused", os.path.dirname(src), outs, words)


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
    """A sharded checkpoint whose 32 rank files are hard links of one file at every cap (65,536
    tensors, 4 MiB of names, a 16 MiB __metadata__; each rank holds one element of its first
    tensor, the rest are listed by no one): every command within the limits, unshard's output
    checked. A reader keeps of each rank file only the tensors metadata.json lists in it, and
    no __metadata__ (before: every header whole, 8 links of it 282 MiB in verify). The issue's
    form, names filling a 20 MB header (the old tool: 484 to 690 MiB), is refused by every
    command by the names cap."""

    def links(ck, first, src, n):
        os.makedirs(ck)
        for r in range(n):
            os.link(src, os.path.join(ck, "rank_%d.safetensors" % r))
        specs = {"rank_%d.safetensors" % r: {"flattened_offsets": [[r, r + 1]], "local_shape": None,
                                             "global_offset": None} for r in range(n)}
        write(os.path.join(ck, "metadata.json"), json.dumps(
            {"tensors": {first: {"shape": [n], "is_sharded": True, "dtype": "U8", "shard_spec_per_file": specs}}}).encode())

    outs = os.path.join(t, "out")
    os.makedirs(outs)
    big_names = _long_names(_CAP, 20_000_000, tag="r")
    big = os.path.join(t, "big.safetensors")
    _st(big, big_names)
    links(os.path.join(t, "ck_big"), big_names[1](0), big, 8)
    refused_by_all("header_hard_links", os.path.join(t, "ck_big"), outs, ["rank_", "names", "4194304 bytes"],
                    _ALL[1:])  # inspect of a sharded checkpoint reads its metadata.json alone
    os.remove(big)
    shutil.rmtree(os.path.join(t, "ck_big"))
    n = 32
    names = _names_of_bytes(_CAP, _NAMES, tag="r")
    data = bytes((i * 13 + 5) % 256 for i in range(_CAP))
    one = os.path.join(t, "one.safetensors")
    _st(one, names, data, metadata_bytes=_MEMBER - 64)
    ck = os.path.join(t, "ck")
    links(ck, names[1](0), one, n)
    for cmd in _ALL:
        run("header_hard_links", command_argv(cmd, ck, outs), 0)
    got, start = _hf_header(os.path.join(outs, "u.safetensors"))
    got.pop("__metadata__", None)
    if got != {names[1](0): {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}:
        raise Failed("unshard wrote " + json.dumps(got)[:200])
    with open(os.path.join(outs, "u.safetensors"), "rb") as f:
        f.seek(start)
        if f.read() != data[:1] * n:  # every rank's element is byte 0 of the one file
            raise Failed("unshard's data differs")
