"""Hostile cases of torch.save archives' own records (issue 53): loaded by hostile.py, with its
helpers (run, case, write, torch_save_bytes, ...) in scope."""
import io
import os
import struct
import zipfile


def archive_with_version(records):
    """A torch.save zip of one F32 tensor 'w' whose version records are `records`
    ({name under archive/: bytes}; none: no version record at all)."""
    good = torch_save_bytes({"w": ("0", 0, (1,), (1,))}, {"0": ("FloatStorage", 1, struct.pack("<f", 1.5))})
    src = zipfile.ZipFile(io.BytesIO(good))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for n in src.namelist():
            if n not in ("archive/version", "archive/.data/version"):
                z.writestr(n, src.read(n))
        for n, data in records.items():
            z.writestr("archive/" + n, data)
    return out.getvalue()


@case
def archive_version(t):
    """Archives whose format version torch refuses (999999, 0, not a number, no version record
    at all) are refused by every command that reads them, naming the record and the rule;
    torch's own choice among two records (.data/version first) is followed, and versions 1 to 10
    are read."""
    for name, records, code, words in (
            ("v999999", {"version": b"999999\n"}, 1, ["archive/version", "format version 999999", "1 to 10"]),
            ("v0", {"version": b"0\n"}, 1, ["archive/version", "format version 0", "1 to 10"]),
            ("text", {"version": b"three\n"}, 1, ["archive/version", "does not hold a format version number"]),
            ("none", {}, 1, ["no archive/version record"]),
            ("data_first", {"version": b"999\n", ".data/version": b"3\n"}, 0, []),
            ("data_refused", {"version": b"3\n", ".data/version": b"11\n"}, 1, ["archive/.data/version", "version 11"]),
            ("v10", {"version": b"10"}, 0, [])):
        d = os.path.join(t, name)
        os.makedirs(d)
        write(os.path.join(d, "pytorch_model.bin"), archive_with_version(records))
        for cmd in (["inspect", d], ["verify", d], ["digest", d], ["to-hf", d, os.path.join(t, name + "-hf")]):
            run("archive_version", cmd, code, ["pytorch_model.bin"] + words if code else [])
