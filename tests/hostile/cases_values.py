"""Values of a training checkpoint (issue 53, round three): what torch.load reads as a value that
is not a tensor is listed by `inspect` as repr() shows it, never as the reader's own marks, and
written by to-dcp where it can be. Loaded by hostile.py (load_case_files) with its helpers in
scope: run, case, Failed, write, torch_zip_of, torch_save_bytes."""
import os
import struct


def _u(s):  # BINUNICODE
    return b"X" + struct.pack("<I", len(s)) + s


def _storage(key, cls=b"FloatStorage", numel=1):  # a storage's persistent id, as torch.save pickles it
    return b"(" + _u(b"storage") + b"ctorch\n" + cls + b"\n" + _u(key) + _u(b"cpu") + b"K" + bytes([numel]) + b"tQ"


@case
def storage_value_text(t):
    """A storage held as a training value (alone, in a list, in a dict) and a dtype beside it:
    `inspect` lists each as a description (the storage's class, key and size; the dtype as torch
    writes it), to-dcp refuses naming the value the same way; no byte of the reader's own marker
    (0xff, not UTF-8) reaches stdout or stderr."""
    f32 = {"data/0": struct.pack("<f", 1.5), "data/1": struct.pack("<2d", 1, 2)}
    pkl = (b"}(" + _u(b"s") + _storage(b"0") +
           _u(b"l") + b"(" + _storage(b"0") + b"K\x07l" +
           _u(b"d") + b"}" + _u(b"st") + _storage(b"1", b"DoubleStorage", 2) + b"s" +
           _u(b"dt") + b"ctorch\nfloat32\n" + b"u")
    pt = os.path.join(t, "values.pt")
    write(pt, torch_zip_of(pkl, f32))
    out, err = run("storage_value_text", ["inspect", pt], 0)
    for want in ("value: <torch.FloatStorage '0' of size 1>", "value: [<torch.FloatStorage '0' of size 1>, 7]",
                 "value: <torch.DoubleStorage '1' of size 2>", "value: torch.float32"):
        if want not in out:
            raise Failed(f"inspect lacks {want!r}: {out!r}")
    for text in (out, err):
        if "\ufffd" in text or "storage'" in text:
            raise Failed(f"inspect shows the reader's marker: {text!r}")
    _, err = run("storage_value_text", ["to-dcp", pt, os.path.join(t, "dcp")], 1,
                 ["values.pt", "value 'd.st'", "(<torch.DoubleStorage '1' of size 2>)", "holds a storage"])
    if "\ufffd" in err:
        raise Failed(f"to-dcp's message shows the reader's marker: {err!r}")


@case
def strided_view(t):
    """A torch.save file holding a view that is not dense (a column slice [6, 4] of a fused [6, 12]
    weight, stride [12, 1], as torch.save writes w[:, :4]) beside a dense tensor: the file is read,
    the view listed as not read and refused by name where a command needs it (to-hf names it and
    the rename that drops it; with it, the other tensor is exported bit for bit); a Hugging Face
    folder's pytorch_model.bin with it is refused naming it; a view whose last element passes its
    storage (torch.load refuses that file) is refused whole."""
    fused = struct.pack("<72f", *[float(i) for i in range(72)])
    other = struct.pack("<3f", 0.5, -1.0, 2.25)
    storages = {"0": ("FloatStorage", 72, fused), "1": ("FloatStorage", 3, other)}
    good = torch_save_bytes({"a": ("0", 0, (6, 4), (12, 1)), "b": ("1", 0, (3,), (1,))}, storages)
    pt = os.path.join(t, "view.pt")
    write(pt, good)
    out, _ = run("strided_view", ["inspect", pt], 0)
    if "1 tensor(s) not read" not in out or "stride [12,1] is not dense for size [6,4]" not in out:
        raise Failed(f"inspect of the view: {out!r}")
    run("strided_view", ["to-hf", pt, os.path.join(t, "hf")], 1,
        ["view.pt", "tensor 'a' [6,4]", "not dense", "a rename rule that drops it"])
    run("strided_view", ["to-hf", pt, os.path.join(t, "hf2"), "--rename", "^a$="], 0)
    st = open(os.path.join(t, "hf2", "model.safetensors"), "rb").read()
    n = struct.unpack_from("<Q", st)[0]
    import json
    h = json.loads(st[8:8 + n])
    b0, b1 = h["b"]["data_offsets"]
    if set(h) - {"__metadata__"} != {"b"} or st[8 + n + b0:8 + n + b1] != other:
        raise Failed(f"to-hf without the view: {sorted(h)}")
    folder = os.path.join(t, "folder")
    os.makedirs(folder)
    write(os.path.join(folder, "pytorch_model.bin"), good)
    run("strided_view", ["inspect", folder], 1, ["pytorch_model.bin", "tensor 'a' [6,4]", "not dense"])
    past = torch_save_bytes({"a": ("0", 60, (6, 4), (12, 1)), "b": ("1", 0, (3,), (1,))}, storages)
    write(os.path.join(t, "past.pt"), past)
    run("strided_view", ["inspect", os.path.join(t, "past.pt")], 1,
        ["past.pt", "tensor 'a'", "pass the end of its storage"])


def _values_file(protocol):
    """A training checkpoint (no tensor) of the values torch.load reads that shardsafe refused
    before: bytes, bytearray, set, frozenset, pickled with `protocol` (2: REDUCEs of builtins and
    codecs.encode, as torch.save writes by default; 4 and 5: their own opcodes)."""
    import pickle
    import zipfile
    import io
    value = {"b": b"ab\xff\x00'", "e": b"", "ba": bytearray(b"x\x80"), "s": {1, 2, 3}, "es": set(),
             "fs": frozenset({"a"}), "t": (b"k", frozenset({(1, 2)})), "epoch": 3}
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle.dumps(value, protocol=protocol))
        z.writestr("archive/version", b"3\n")
    return out.getvalue()


@case
def bytes_and_sets(t):
    """bytes, bytearray, set and frozenset values of a training checkpoint (protocols 2, 4 and 5):
    listed by inspect as repr() writes them, written by to-dcp; a set with an item Python holds
    equal to another (1 and True, written by hand: Python's pickler cannot) keeps one; a set
    holding a list (torch.load refuses it: unhashable), ADDITEMS on a frozenset and a bytes of a
    code point past U+00FF are refused naming the value or the opcode."""
    for p in (2, 4, 5):
        pt = os.path.join(t, f"v{p}.pt")
        write(pt, _values_file(p))
        out, _ = run("bytes_and_sets", ["inspect", pt], 0)
        for want in ("value: b\"ab\\xff\\x00'\"", "value: b''", "value: bytearray(b'x\\x80')", "value: {1, 2, 3}",
                     "value: set()", "value: frozenset({'a'})", "value: (b'k', frozenset({(1, 2)}))"):
            if want not in out:
                raise Failed(f"inspect of protocol {p} lacks {want!r}: {out!r}")
        out, _ = run("bytes_and_sets", ["to-dcp", pt, os.path.join(t, f"dcp{p}")], 0)
        if "8 non-tensor items" not in out:
            raise Failed(f"to-dcp of protocol {p}: {out!r}")
    for name, pkl, code, words in (
            ("equal_items", b"}(" + _u(b"s") + b"c__builtin__\nset\n](K\x01\x88K\x02e\x85Ru", 0, []),
            ("unhashable", b"}(" + _u(b"s") + b"c__builtin__\nset\n](]e\x85Ru", 1,
             ["value 's'", "set holds a list", "cannot hash"]),
            ("frozen_additems", b"}(" + _u(b"s") + b"(K\x01\x91(K\x02\x90u", 1, ["ADDITEMS on a frozenset"]),
            ("latin1", b"}(" + _u(b"s") + b"c_codecs\nencode\n" + _u("\u0100".encode()) + _u(b"latin1") + b"\x86Ru",
             1, ["_codecs.encode", "past U+00FF"])):
        pt = os.path.join(t, name + ".pt")
        write(pt, torch_zip_of(pkl, {}))
        out, _ = run("bytes_and_sets", ["inspect", pt], code, [name + ".pt"] + words if code else [])
        if name == "equal_items" and "value: {1, 2}" not in out:
            raise Failed(f"a set of 1, True and 2: {out!r}")


def _nested(depth, protocol=2):
    """A training checkpoint whose value 'x' is `depth` lists, each inside the one before, beside
    dicts nested as deep (names 'd.k.k...') and tuples."""
    import pickle
    import sys
    import io
    import zipfile
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 4 * depth + 1000))
    lst, tup, d = [], (), 1
    for _ in range(depth - 1):
        lst, tup, d = [lst], (tup,), {"k": d}
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle.dumps({"x": lst, "t": tup, "d": d}, protocol=protocol))
        z.writestr("archive/version", b"3\n")
    return out.getvalue()


@case
def deep_values(t):
    """Values nested 999 deep (lists, tuples, dicts: what Python's pickler writes within its
    recursion limit) are read by inspect and to-dcp within a 1 MiB call stack; 1,001 and 60,000
    levels are refused ("nests deeper than 1000"), the latter without recursing 60,000 deep."""
    pt = os.path.join(t, "deep.pt")
    write(pt, _nested(999))
    run("deep_values", ["inspect", pt], 0, stack_kib=1024)
    out, _ = run("deep_values", ["to-dcp", pt, os.path.join(t, "dcp")], 0, stack_kib=1024)
    if "3 non-tensor items" not in out:
        raise Failed(f"to-dcp of the deep values: {out!r}")
    for depth in (1002, 60000):
        lists = b"]" * depth + b"a" * (depth - 1)  # each list appended to the one before
        pt = os.path.join(t, f"deep{depth}.pt")
        write(pt, torch_zip_of(b"}(" + _u(b"x") + lists + b"u", {}))
        run("deep_values", ["inspect", pt], 1, [f"deep{depth}.pt", "nests deeper than 1000"], stack_kib=1024)
