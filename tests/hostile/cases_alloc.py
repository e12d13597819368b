"""Hostile cases of refusals (and reads) that allocated first (issue 53): bytes after a DCP
`.metadata` pickle's STOP, a zip central directory whose 16-bit record count wrapped, a long
string in a checksum sidecar, checksum blocks larger than any read window. Each used more than
the suite's memory limit before it was read (or refused) in bounded memory.

Loaded by hostile.py (load_case_files) with its helpers in scope: run, case, Failed, write,
safetensors_bytes, sharded_checkpoint, dcp_folder, torch_save_bytes, ...
"""
import ctypes
import hashlib
import io
import json
import os
import shutil
import struct
import subprocess
import zipfile

_COMMANDS = ("verify", "digest", "unshard", "to-hf", "to-dcp")


def _every_command(case_name, src, outs, code, words=()):
    """Runs every command that reads src (inspect, and those of _COMMANDS, writing under outs);
    returns digest's output."""
    os.makedirs(outs, exist_ok=True)
    got = None
    for cmd in ("inspect",) + _COMMANDS:
        argv = [cmd, src]
        if cmd == "unshard":
            argv.append(os.path.join(outs, "u.safetensors"))
        elif cmd in ("to-hf", "to-dcp"):
            argv.append(os.path.join(outs, cmd))
        out, _ = run(case_name, argv, code, words)
        if cmd == "digest":
            got = out
    shutil.rmtree(outs)
    return got


@case
def metadata_trailing_bytes(t):
    """A DCP `.metadata` whose pickle is followed by zeros (sparse) to 1 GiB, and past 1 GiB:
    Python's unpickler stops at STOP and never reads them, so torch reads the folder. Every
    command reads it as the folder without them (same digest), in the memory its pickle needs."""
    plain = os.path.join(t, "plain")
    dcp_folder(plain)
    want, _ = run("metadata_trailing_bytes", ["digest", plain], 0)
    for name, size in (("to_1gib", 1 << 30), ("past_1gib", (1 << 30) + (1 << 20))):
        d = os.path.join(t, name)
        dcp_folder(d)
        with open(os.path.join(d, ".metadata"), "r+b") as f:
            f.truncate(size)
        got = _every_command("metadata_trailing_bytes", d, os.path.join(t, name + "-out"), 0)
        if got != want:
            raise Failed(f"digest with {size} bytes of .metadata: {got!r}, without the trailing bytes {want!r}")
        shutil.rmtree(d)


def _wrapped_zip(front, extras, back, extra_name_len):
    """A torch.save zip of one F32 tensor 'w' [2] holding `extras` more records (central directory
    entries only, named archive/extra/NNN... of extra_name_len bytes), its real records' entries
    `front` before them and `back` after; the end record without zip64, so its 16-bit count is
    the true count mod 65536, as a writer that ignores the limit leaves it."""
    good = torch_save_bytes({"w": ("0", 0, (2,), (1,))}, {"0": ("FloatStorage", 2, struct.pack("<2f", 1.5, 2.5))})
    src = zipfile.ZipFile(io.BytesIO(good))
    body = io.BytesIO()
    central = {}
    with zipfile.ZipFile(body, "w", zipfile.ZIP_STORED) as z:
        for n in src.namelist():
            z.writestr(n, src.read(n))
    data = body.getvalue()
    cd_at = struct.unpack_from("<I", data, data.rindex(b"PK\x05\x06") + 16)[0]
    p = cd_at
    while data[p:p + 4] == b"PK\x01\x02":
        n, x, c = struct.unpack_from("<HHH", data, p + 28)
        central[data[p + 46:p + 46 + n].decode()] = data[p:p + 46 + n + x + c]
        p += 46 + n + x + c
    names = list(central)
    parts = [central[n] for n in names if n in front]
    for i in range(extras):
        name = ("archive/extra/%d-" % i).encode()
        name += b"x" * (extra_name_len - len(name))
        parts.append(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014b50, 20, 20, 0, 0, 0, 0, 0, 0, 0, len(name), 0, 0, 0,
                                 0, 0, 0) + name)
    parts += [central[n] for n in names if n in back]
    cd = b"".join(parts)
    count = len(parts) & 0xffff
    return data[:cd_at] + cd + struct.pack("<IHHHHIIH", 0x06054b50, 0, 0, count, count, len(cd), cd_at, 0)


def _torch_reads(data):
    """Whether torch 1.13 (/usr/bin/python3, where it has torch) loads the file: True, False, or
    None without torch."""
    probe = ("import io, sys, torch\ntry:\n    torch.load(io.BytesIO(sys.stdin.buffer.read()))\n"
             "except Exception:\n    sys.exit(3)\n")
    try:
        r = subprocess.run(["/usr/bin/python3", "-c", probe], input=data, capture_output=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode == 0:
        return True
    return False if r.returncode == 3 else None


@case
def zip_count_wrapped(t):
    """torch.save files of more than 65,535 records without zip64 (the end record's count wrapped
    to the true count mod 65536): torch's zip reader (miniz) reads as many records as the count
    says, not the whole directory as Python's zipfile does, so a file whose records come first
    loads and one whose data.pkl or storage lies past the count is refused (checked against torch
    1.13 where /usr/bin/python3 has it). shardsafe reads the same records, walking the directory
    a window at a time: a 240 MB directory of 2,000-byte names is refused in little memory."""
    real = ("archive/data.pkl", "archive/version", "archive/data/0")
    ok = _wrapped_zip(real, 70000, (), 40)
    d = os.path.join(t, "ok")
    write(os.path.join(d, "pytorch_model.bin"), ok)
    out, _ = run("zip_count_wrapped", ["digest", d], 0)
    want = "w F32 [2] " + hashlib.sha256(struct.pack("<2f", 1.5, 2.5)).hexdigest() + "\n"
    if out != want:
        raise Failed(f"digest of the file whose records come first: {out!r}, expected {want!r}")
    # data.pkl and version inside the count, the storage's record past it: 120,003 records, count 54,467
    past = _wrapped_zip(("archive/data.pkl", "archive/version"), 120000, ("archive/data/0",), 2000)
    peer = (_torch_reads(ok), _torch_reads(past))
    if peer[0] is not None and peer != (True, False):
        raise Failed(f"torch 1.13 read the file with its records first: {peer[0]}, past the count: {peer[1]}")
    d = os.path.join(t, "past")
    write(os.path.join(d, "pytorch_model.bin"), past)
    del past
    for cmd in ("inspect", "verify", "digest"):
        run("zip_count_wrapped", [cmd, d], 1, ["pytorch_model.bin", "no record 'archive/data/0'"])


def _xxh3_stream(path, offset, length, block):
    """XXH3-64 hex digests of each `block` bytes of [offset, offset + length) of the file, hashed
    1 MiB at a time through libxxhash's streaming API (the tool's xxHash)."""
    x = ctypes.CDLL("libxxhash.so.0")
    x.XXH3_createState.restype = ctypes.c_void_p
    x.XXH3_64bits_reset.argtypes = [ctypes.c_void_p]
    x.XXH3_64bits_update.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    x.XXH3_64bits_digest.restype = ctypes.c_uint64
    x.XXH3_64bits_digest.argtypes = [ctypes.c_void_p]
    x.XXH3_freeState.argtypes = [ctypes.c_void_p]
    st = x.XXH3_createState()
    out = []
    with open(path, "rb") as f:
        f.seek(offset)
        for b0 in range(0, length, block):
            x.XXH3_64bits_reset(st)
            left = min(block, length - b0)
            while left:
                chunk = f.read(min(left, 1 << 20))
                x.XXH3_64bits_update(st, chunk, len(chunk))
                left -= len(chunk)
            out.append("%016x" % x.XXH3_64bits_digest(st))
    x.XXH3_freeState(st)
    return out


def _one_rank_checkpoint(d, n, checksums):
    """A checkpoint of one rank file holding F32 'w' [n] of sparse bytes (zeros but for a few:
    a 1-byte mark every 64 MiB); checksums: (block_bytes, sidecars) or None."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}}).encode()
    header += b" " * ((8 - len(header) % 8) % 8)
    path = os.path.join(d, "rank_0.safetensors")
    os.makedirs(d, exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + 4 * n)
        for at in range(0, 4 * n, 64 << 20):
            f.seek(8 + len(header) + at)
            f.write(bytes([1 + at % 251]))
    md = {"tensors": {"w": {"shape": [n], "is_sharded": False, "dtype": "F32", "shard_spec_per_file": {
        "rank_0.safetensors": {"flattened_offsets": [[0, n]], "local_shape": None, "global_offset": None}}}}}
    if checksums:
        block, sidecars = checksums
        table = {"w": _xxh3_stream(path, 8 + len(header), 4 * n, block)}
        cs = {"algorithm": "xxh3-64", "block_bytes": block, "files": {}}
        if sidecars:
            cs["sidecars"] = True
            write(os.path.join(d, "rank_0.checksums.json"), json.dumps(table).encode())
        else:
            cs["files"]["rank_0.safetensors"] = table
        md["shardsafe"] = {"checksums": cs}
    write(os.path.join(d, "metadata.json"), json.dumps(md).encode())


@case
def sidecar_long_string(t):
    """A checksum sidecar (rank_R.checksums.json, the compact form's) holding a 200 MB string
    where a tensor's 16-hex-digit hashes go: refused by every command that reads the checksums,
    before the string is read (a sidecar is at most what its file's tensors' hashes can take)."""
    d = os.path.join(t, "ck")
    _one_rank_checkpoint(d, 1024, (64, True))
    run("sidecar_long_string", ["verify", d], 0)
    with open(os.path.join(d, "rank_0.checksums.json"), "wb") as f:
        f.write(b'{"w": ["')
        chunk = b"0123456789abcdef" * 65536
        for _ in range(200 * 1000 * 1000 // len(chunk)):
            f.write(chunk)
        f.write(b'"]}')
    for cmd in _COMMANDS:
        argv = [cmd, d] + ([os.path.join(t, "out-" + cmd)] if cmd != "verify" and cmd != "digest" else [])
        if cmd == "unshard":
            argv[-1] += ".safetensors"
        run("sidecar_long_string", argv, 1, ["rank_0.checksums.json", "more than", "can need"])


@case
def checksum_block_huge(t):
    """Checksums of 512 MiB blocks (block_bytes 2^29) of a 512 MiB tensor (sparse on disk):
    verify, digest and unshard check its one block hashed a piece at a time, in bounded memory,
    with the hash of the whole block (libxxhash's streaming XXH3 here); a damaged byte is still
    found. (Each window of unshard and digest hashes the whole block again: 512 MiB keeps that
    short.)"""
    d = os.path.join(t, "ck")
    n = 1 << 27  # F32 elements: 512 MiB
    _one_rank_checkpoint(d, n, (1 << 29, False))
    o = os.path.join(t, "o")
    os.makedirs(o)
    run("checksum_block_huge", ["verify", d], 0)
    run("checksum_block_huge", ["digest", d], 0)
    run("checksum_block_huge", ["unshard", d, os.path.join(o, "u.safetensors")], 0)
    os.remove(os.path.join(o, "u.safetensors"))
    with open(os.path.join(d, "rank_0.safetensors"), "r+b") as f:
        f.seek(-12345, os.SEEK_END)
        f.write(b"\x40")
    run("checksum_block_huge", ["verify", d], 1, ["rank_0.safetensors", "'w'", "block 0"])
    run("checksum_block_huge", ["digest", d], 1, ["rank_0.safetensors", "'w'", "block 0"])
