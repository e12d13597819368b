"""VALID inputs at the documented limits (issue 53: every documented limit reachable within
LIMIT_MIB and LIMIT_S): each case builds a valid file near one limit in its temporary folder,
runs the commands that read it and checks exit 0, what they print, and the limits. Loaded by
hostile.py, with its helpers (run, case, write, Failed, ...) in scope.

The files are large (65,536 storages), so they are written by hand here (a zip's records and a
pickle's opcodes, as torch writes them; torch 1.13's torch.load reads each) rather than through
zipfile and pickle, which take minutes over a million records.

A torch.save file's limits (docs/FORMAT.md §3) are what the tool reads within LIMIT_MIB: 2^16
storages, 2^18 tensors and values (a tensor counting 4: 2^16 tensors), 4 MiB of their names,
2^19 ints, floats, strs and containers in the values, 2^21 values made by the pickle's reader.
Each is reached by a valid file here, and each file one past it is refused, naming the rule,
before the rest of the file is read."""
import os
import struct
import zlib


def fast_zip(records):
    """A zip (stored, zip64 end records when over 65,535 records) of records: (name, bytes)
    pairs, as torch writes its archives but without the 64-byte alignment of each record's data."""
    body, central, off = [], [], 0
    for name, data in records:
        n = name.encode()
        crc = zlib.crc32(data)
        local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0x21, crc, len(data), len(data), len(n), 0)
        central.append(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0x21, crc, len(data), len(data),
                                   len(n), 0, 0, 0, 0, 0, off) + n)
        body.append(local + n + data)
        off += len(local) + len(n) + len(data)
    cd = b"".join(central)
    count = len(central)
    tail = b""
    if count > 0xFFFF:
        z64 = off + len(cd)
        tail += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, len(cd), off)
        tail += struct.pack("<IIQI", 0x07064B50, 0, z64, 1)
        tail += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, len(cd), off, 0)
    else:
        tail += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, len(cd), off, 0)
    return b"".join(body) + cd + tail


def _short(s):
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def _int(i):
    if 0 <= i < 256:
        return b"K" + bytes([i])
    if 0 <= i < 65536:
        return b"M" + struct.pack("<H", i)
    return b"J" + struct.pack("<i", i)


def big_state_dict_pickle(n, legacy=False, shared=False, width=0):
    """A torch.save state dict's pickle (protocol 2, as torch's pickler writes it, with the
    globals and the persistent id's constant strs memoized once) of n F32 tensors of one element
    named w0, w1, ..., tensor i over its own storage str(i); a legacy persistent id has its
    sixth field, None; with shared, every tensor is over storage '0'; names padded with 'x' to
    `width` bytes. About 53 bytes a tensor and its name."""
    head = (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\nq\x00ctorch\nFloatStorage\nq\x01"
            b"ccollections\nOrderedDict\nq\x02X\x07\x00\x00\x00storageq\x03X\x03\x00\x00\x00cpuq\x04"
            b"00000h\x02)R(")  # the five memoized, popped, then an OrderedDict() and a MARK
    tail = b"K\x00K\x01\x85K\x01\x85\x89h\x02)RtR"
    pid_end = b"h\x04K\x01" + (b"N" if legacy else b"") + b"tQ"
    parts = [head]
    for i in range(n):
        parts.append(_short(f"w{i}".ljust(width, "x")) + b"h\x00((h\x03h\x01" + _short(str(0 if shared else i)) + pid_end + tail)
        if i % 1000 == 999:
            parts.append(b"u(")
    parts.append(b"u.")
    return b"".join(parts)


def big_torch_zip(n, shared=False, extra=0, width=0):
    """A pytorch_model.bin of n one-element F32 tensors, each over a storage of its own (or all
    over one, shared), named in `width` bytes, and `extra` records more that torch does not read."""
    one = struct.pack("<f", 1.5)
    records = [("archive/data.pkl", big_state_dict_pickle(n, shared=shared, width=width))]
    records += [(f"archive/data/{i}", one) for i in range(1 if shared else n)]
    records += [(f"archive/extra/{i}", b"") for i in range(extra)]
    records.append(("archive/version", b"3\n"))
    return fast_zip(records)


def big_torch_legacy(n):
    """A legacy-format torch.save file of n one-element F32 tensors over n storages."""
    import pickle
    import io
    out = io.BytesIO()
    for v in (0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001, "little_endian": True,
                                               "type_sizes": {"short": 2, "int": 4, "long": 8}}):
        pickle.dump(v, out, protocol=2)
    out.write(big_state_dict_pickle(n, legacy=True))
    keys = [str(i) for i in range(n)]
    pickle.dump(keys, out, protocol=2)
    one = struct.pack("<q", 1) + struct.pack("<f", 1.5)
    out.write(one * n)
    return out.getvalue()


def big_values_pt(n):
    """A training .pt (zip) whose data.pkl is a dict of n int values and no tensor: {'k0': 0, ...}."""
    parts = [b"\x80\x02}("]
    for i in range(n):
        parts.append(_short(f"k{i}") + _int(i))
        if i % 1000 == 999:
            parts.append(b"u(")
    parts.append(b"u.")
    return fast_zip([("archive/data.pkl", b"".join(parts)), ("archive/version", b"3\n")])


def value_list_pt(item, n):
    """A training .pt (zip) whose data.pkl is {'x': [item] * n} (item: the opcodes of one value,
    written n times, 1,000 to an APPENDS as Python does): one value of 1 + n ints, strs or lists."""
    parts = [b"\x80\x02}(X\x01\x00\x00\x00x]"]
    for i in range(0, n, 1000):
        parts.append(b"(" + item * min(1000, n - i) + b"e")
    parts.append(b"u.")
    return fast_zip([("archive/data.pkl", b"".join(parts)), ("archive/version", b"3\n")])


def made_pt(n):
    """A training .pt whose pickle makes n lists it drops (an empty list, POP), then {'x': 1}:
    a valid file (torch.load reads it) of one value whose reader makes n + 3 values."""
    body = b"]0" * n
    return fast_zip([("archive/data.pkl", b"\x80\x02" + body + b"}X\x01\x00\x00\x00xK\x01s."),
                     ("archive/version", b"3\n")])


TENSORS = 1 << 16    # max_torch_save_tensors, max_torch_save_storages
ITEMS = 1 << 18      # max_torch_save_items (a tensor counts 4)
NAMES = 4 << 20      # max_torch_save_name_bytes
CONTENTS = 1 << 19   # max_torch_save_value_contents
MADE = 1 << 21       # max_torch_save_pickle_made


def _values_to_dcp(name, t, n):
    pt = os.path.join(t, "train.pt")
    write(pt, big_values_pt(n))
    out, _ = run(name, ["inspect", pt], 0)
    if out.count("  value: ") != n or "value: %d\n" % (n - 1) not in out:
        raise Failed(f"inspect listed {out.count('  value: ')} values, not {n}")
    d = os.path.join(t, "dcp")
    out, _ = run(name, ["to-dcp", pt, d], 0)
    if f"0 tensors and {n} non-tensor items" not in out:
        raise Failed(f"to-dcp: {out!r}")
    # each value's archive (a torch.save zip of its pickle) lies in the data file, the
    # .metadata names every key: sizes counted here, not by the tool
    size = os.path.getsize(os.path.join(d, "__0_0.distcp"))
    with open(os.path.join(d, "__0_0.distcp"), "rb") as f:
        archives = f.read().count(b"PK\x05\x06")
    with open(os.path.join(d, ".metadata"), "rb") as f:
        md = f.read()
    if archives != n or md.count(b"BytesStorageMetadata") != n or (b"k%d" % (n - 1)) not in md:
        raise Failed(f"to-dcp wrote {archives} archives in {size} bytes, .metadata of {len(md)} bytes")


@case
def big_torch_values(t):
    """A training .pt whose dict holds 2^18 int values, the most tensors and values a torch.save
    file may hold: inspect and to-dcp within the limits (to-dcp about 190 MiB), every value
    written."""
    _values_to_dcp("big_torch_values", t, ITEMS)


@case
def big_torch_bin(t):
    """A pytorch_model.bin of 2^16 tensors, each over its own storage record and named in 64 bytes
    (the most storages, tensors and names' bytes a torch.save file may hold): verify, inspect,
    digest, to-hf and to-dcp within the limits (to-dcp about 225 MiB; 1,040,000 tensors took
    verify 1.7 GiB)."""
    d = os.path.join(t, "bin")
    os.makedirs(d)
    n = TENSORS
    write(os.path.join(d, "pytorch_model.bin"), big_torch_zip(n, width=NAMES // n))
    out, _ = run("big_torch_bin", ["verify", d], 0)
    if f"{n} tensors valid" not in out:
        raise Failed(f"verify: {out!r}")
    out, _ = run("big_torch_bin", ["inspect", d], 0)
    if out.count("\n") != n + 2:
        raise Failed(f"inspect listed {out.count(chr(10)) - 2} tensors, not {n}")
    out, _ = run("big_torch_bin", ["digest", d], 0)
    if out.count("\n") != n:
        raise Failed(f"digest gave {out.count(chr(10))} lines, not {n}")
    run("big_torch_bin", ["to-hf", d, os.path.join(t, "hf")], 0)
    out, _ = run("big_torch_bin", ["to-dcp", d, os.path.join(t, "dcp")], 0)
    if f"{n} tensors" not in out:
        raise Failed(f"to-dcp: {out!r}")


@case
def big_torch_legacy_file(t):
    """A legacy-format pytorch_model.bin of 2^16 storages: verify, inspect, digest, to-hf within
    the limits (200,000 storages took about 340 MiB)."""
    d = os.path.join(t, "legacy")
    os.makedirs(d)
    n = TENSORS
    write(os.path.join(d, "pytorch_model.bin"), big_torch_legacy(n))
    out, _ = run("big_torch_legacy_file", ["verify", d], 0)
    if f"{n} tensors valid" not in out:
        raise Failed(f"verify: {out!r}")
    out, _ = run("big_torch_legacy_file", ["inspect", d], 0)
    if out.count("\n") != n + 2:
        raise Failed(f"inspect listed {out.count(chr(10)) - 2} tensors, not {n}")
    run("big_torch_legacy_file", ["digest", d], 0)
    run("big_torch_legacy_file", ["to-hf", d, os.path.join(t, "hf")], 0)


@case
def big_torch_value_contents(t):
    """A training .pt of one value, a list of 2^19 - 1 empty lists (2^19 lists, the most a torch.save
    file's values may hold): inspect and to-dcp within the limits (a million such lists took
    inspect 296 MiB); one more list is refused by name."""
    pt = os.path.join(t, "lists.pt")
    write(pt, value_list_pt(b"]", CONTENTS - 1))
    out, _ = run("big_torch_value_contents", ["inspect", pt], 0)
    if "value: [[], [], " not in out:
        raise Failed(f"inspect: {out[:200]!r}")
    out, _ = run("big_torch_value_contents", ["to-dcp", pt, os.path.join(t, "dcp")], 0)
    if "0 tensors and 1 non-tensor items" not in out:
        raise Failed(f"to-dcp: {out!r}")
    write(pt, value_list_pt(b"]", CONTENTS))
    run("big_torch_value_contents", ["inspect", pt], 1, ["lists.pt", "value 'x'", str(CONTENTS)])


@case
def big_torch_past_limits(t):
    """Files one past each limit of a torch.save file, refused by name before the rest is read
    (the tool before these limits read each, the largest taking 1.7 GiB): 2^16 + 1 storages (zip
    and legacy), 2^16 + 1 tensors over one storage, 2^18 + 1 values, 2^15 tensors named in 129
    bytes (4 MiB and 32 KiB of names), a pickle making 2^21 values it drops and keeps one, and
    2^16 + 1,025 records (refused from the end record alone)."""
    # (data, words of the refusal, MiB it may take: bounded by the limit it passes, the most
    # 2^16 storages read; records are refused from the end record alone)
    files = {"storages": (big_torch_zip(TENSORS + 1), ["names a storage more than the 65536"], 128),
             "legacy": (big_torch_legacy(TENSORS + 1), ["names a storage more than the 65536"], 128),
             "tensors": (big_torch_zip(TENSORS + 1, shared=True), ["more tensors and values than", "'w65536'"], 128),
             "values": (big_values_pt(ITEMS + 1), ["more tensors and values than", "'k262144'"], 128),
             "names": (big_torch_zip(TENSORS // 2, shared=True, width=129), ["names", "pass 4194304 bytes",
                                                                              "'w32513xxx"], 128),
             "made": (made_pt(MADE), ["makes more than 2097152 values"], 128),
             # data.pkl, data/0, version and 2^16 + 1,022 more: one past 2^16 + 1,024
             "records": (big_torch_zip(1, extra=TENSORS + 1022), ["66561 records", "at most 66560"], 128)}
    for name, (data, _, _) in files.items():
        write(os.path.join(t, name + ".pt"), data)
    refusals = [(name, words, mib) for name, (_, words, mib) in files.items()]
    del files, data  # the tool's peak RSS counts what it shares with this process when forked
    for name, words, mib in refusals:
        run("big_torch_past_limits", ["inspect", os.path.join(t, name + ".pt")], 1, [name + ".pt"] + words,
            limit_mib=mib)
    # at the last of these limits: the pickle makes 2^21 values in all (the dict, its key and
    # the int 1 are three of them), within the limits
    write(os.path.join(t, "made.pt"), made_pt(MADE - 3))
    out, _ = run("big_torch_past_limits", ["inspect", os.path.join(t, "made.pt")], 0)
    if "value: 1" not in out:
        raise Failed(f"inspect: {out!r}")
