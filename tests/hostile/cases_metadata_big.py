"""Hostile cases of large metadata (docs/FORMAT.md §2, "Size" and "Checksums"; issue 53): a
listed metadata.json at its 32 MiB limit, and a checksum table at its 2^20 hashes, are read by
every command within the suite's limits, with the bytes they write checked against the tensors
built here; one byte or one hash past the limit is refused before the file is read, naming it and
the rule. Loaded by hostile.py, with its helpers (run, case, Failed, write, ...) in scope."""
import ctypes
import hashlib
import json
import os
import shutil
import struct

MAX_METADATA = 32 << 20  # bytes of a metadata.json (max_checkpoint_metadata_size)
MAX_ENTRIES = 1 << 18    # shard entries a metadata.json may list (max_listed_metadata_entries)
MAX_HASHES = 1 << 20     # hashes of a checkpoint's checksum tables (max_checksum_hashes)
_OUTPUTS = ("unshard", "to-hf", "to-dcp")


def _st_bytes(entries):
    """A safetensors file: entries (name, dtype, shape, data), header built by joins (fast)."""
    parts, off = [], 0
    for n, dt, shape, b in entries:
        parts.append('"%s":{"dtype":"%s","shape":[%s],"data_offsets":[%d,%d]}' %
                     (n, dt, ",".join(map(str, shape)), off, off + len(b)))
        off += len(b)
    h = ("{" + ",".join(parts) + "}").encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(b for _, _, _, b in entries)


def _read_st(path):
    """{name: (dtype, shape, bytes)} of a safetensors file (json here, not the tool)."""
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
            for k, v in header.items()}


def _listed_checkpoint(d, ranks, tensors, compact_json):
    """A valid checkpoint in the listed form, as OLMo-core writes it (one entry per file per
    tensor): U8 tensors layers.I.w [ranks], rank R's file holding element R of each. compact_json:
    no spaces and no null fields (the most entries a byte of metadata.json can hold). Returns
    ({name: full bytes}, metadata.json's text)."""
    os.makedirs(d)
    names = ["layers.%d.w" % i for i in range(tensors)]
    full = {n: bytes((r * 7 + i * 13) % 256 for r in range(ranks)) for i, n in enumerate(names)}
    for r in range(ranks):
        with open(os.path.join(d, "rank_%d.safetensors" % r), "wb") as f:
            f.write(_st_bytes([(n, "U8", [1], full[n][r:r + 1]) for n in names]))
    if compact_json:
        spec = '"rank_%d.safetensors":{"flattened_offsets":[[%d,%d]]}'
        entry = '"%s":{"shape":[%d],"is_sharded":true,"dtype":"U8","shard_spec_per_file":%s}'
        sep = ","
    else:
        spec = '"rank_%d.safetensors": {"flattened_offsets": [[%d, %d]], "local_shape": null, "global_offset": null}'
        entry = '"%s": {"shape": [%d], "is_sharded": true, "dtype": "U8", "shard_spec_per_file": %s}'
        sep = ", "
    specs = "{" + sep.join(spec % (r, r, r + 1) for r in range(ranks)) + "}"
    text = '{"tensors": {' + sep.join(entry % (n, ranks, specs) for n in names) + "}}"
    return full, text.encode()


def _check_every_command(case_name, d, outs, full):
    """Every command succeeds on d; digest's hashes, unshard's and to-hf's tensors and to-dcp's
    folder (digested again) are those of `full` (U8 tensors of one dimension)."""
    out, _ = run(case_name, ["inspect", d], 0)
    if not set(full) <= {line.split()[0] for line in out.split("\n") if line.strip()}:
        raise Failed(f"inspect does not list the {len(full)} tensors: {out[-400:]}")
    out, _ = run(case_name, ["verify", d], 0)
    if f": {len(full)} tensors valid" not in out:
        raise Failed(f"verify: {out[-400:]}")
    want = sorted("%s U8 [%d] %s" % (k, len(v), hashlib.sha256(v).hexdigest()) for k, v in full.items())
    out, _ = run(case_name, ["digest", d], 0)
    if out.split("\n")[:-1] != want:
        raise Failed(f"digest: {out[:300]!r}..., expected {want[:2]!r}...")
    os.makedirs(outs)
    one = os.path.join(outs, "all.safetensors")
    run(case_name, ["unshard", d, one], 0)
    hf = os.path.join(outs, "hf")
    run(case_name, ["to-hf", d, hf], 0)
    expect = {k: ("U8", [len(v)], v) for k, v in full.items()}
    for path in (one, os.path.join(hf, "model.safetensors")):
        if _read_st(path) != expect:
            raise Failed(f"{path}: tensors differ from those written")
    dcp = os.path.join(outs, "dcp")
    run(case_name, ["to-dcp", d, dcp], 0)
    out, _ = run(case_name, ["digest", dcp], 0)
    if out.split("\n")[:-1] != want:
        raise Failed("digest of the DCP export differs from the tensors written")
    shutil.rmtree(outs)


def _written(p):
    """Whether an output is there (a file, or a folder with something in it)."""
    return os.path.exists(p) and (os.path.isfile(p) or bool(os.listdir(p)))


def _refused_by_every_command(case_name, d, outs, words):
    for cmd in ("inspect", "verify", "digest") + _OUTPUTS:
        argv = [cmd, d]
        if cmd in _OUTPUTS:
            argv.append(os.path.join(outs, cmd + (".safetensors" if cmd == "unshard" else "")))
        run(case_name, argv, 1, words)
        if cmd in _OUTPUTS and _written(argv[-1]):
            raise Failed(f"{cmd} wrote {argv[-1]} though it refused")


def _pad_to(path, size):
    """Spaces after the document (JSON allows them) until the file has `size` bytes."""
    left = size - os.path.getsize(path)
    if left < 0:
        raise Failed(f"{path} is already over {size} bytes")
    with open(path, "ab") as f:
        while left:
            n = min(left, 1 << 24)
            f.write(b" " * n)
            left -= n


@case
def metadata_listed_at_limit(t):
    """A valid listed metadata.json at both limits (FORMAT.md §2, "Size"): 2,048 ranks x 128
    tensors (2^18 entries, the most it may list) as OLMo-core writes it (json.dumps' spaces, null
    fields: 28 MB), padded with spaces to 32 MiB exactly: every command succeeds within the limits,
    its output checked. One entry more (a tensor of one file), one byte more, and the document
    padded to 200 MB (the issue's: 775-1,101 MiB, unshard 41 s) are refused by every command, the
    entry as it is read, the bytes before reading, naming the file and the limit. (The old tool
    read up to 1 GiB and any number of entries: it took all three, the 200 MB one past the
    limits.)"""
    d = os.path.join(t, "olmo")
    full, text = _listed_checkpoint(d, 2048, 128, False)
    md = os.path.join(d, "metadata.json")
    write(md, text)
    if not MAX_METADATA - (8 << 20) < len(text) <= MAX_METADATA:
        raise Failed(f"metadata.json of {len(text)} bytes, not near the limit")
    kept = os.path.join(t, "metadata.kept")
    write(kept, text)
    # with one entry more: a tensor held whole by rank 0's file (which holds it too)
    more = text[:-2] + (b', "extra": {"shape": [1], "is_sharded": false, "dtype": "U8", "shard_spec_per_file": '
                        b'{"rank_0.safetensors": {"flattened_offsets": [[0, 1]], "local_shape": null, '
                        b'"global_offset": null}}}}}')
    write(os.path.join(t, "metadata.more"), more)
    del text, more  # (the suite's process is measured too: its pages count until the tool's exec)
    _pad_to(md, MAX_METADATA)
    _check_every_command("metadata_listed_at_limit", d, os.path.join(t, "olmo-out"), full)
    write(os.path.join(d, "rank_0.safetensors"),
          _st_bytes([(n, "U8", [1], full[n][0:1]) for n in full] + [("extra", "U8", [1], b"\x09")]))
    shutil.copyfile(os.path.join(t, "metadata.more"), md)
    _refused_by_every_command("metadata_listed_at_limit", d, os.path.join(t, "past-out"),
                              ["metadata.json", "tensor 'extra'", f"more than {MAX_ENTRIES} shard entries",
                               "compact form"])
    shutil.copyfile(kept, md)
    words = ["metadata.json", f"{MAX_METADATA + 1} bytes", f"more than the {MAX_METADATA}", "compact form"]
    _pad_to(md, MAX_METADATA + 1)
    _refused_by_every_command("metadata_listed_at_limit", d, os.path.join(t, "past-out"), words)
    _pad_to(md, 200 * 1000 * 1000)
    words[1] = "200000000 bytes"
    _refused_by_every_command("metadata_listed_at_limit", d, os.path.join(t, "past-out"), words)


def _xxh3_hex(b):
    x = ctypes.CDLL("libxxhash.so.0")
    x.XXH3_64bits.restype = ctypes.c_uint64
    x.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    return "%016x" % x.XXH3_64bits(b, len(b))


def _hashed_checkpoint(d, files, blocks, sidecar, block=4):
    """`files` rank files, file R holding U8 'wR' [blocks * block] whole: zeros but for byte 1 of
    each 4 KiB page, R + 1 there (the rest sparse), with checksums of `block` bytes: in sidecars
    (the compact form's rank_R.checksums.json) or in metadata.json. Returns {name: bytes}."""
    n = blocks * block
    os.makedirs(d)
    full, tables, specs = {}, {}, []
    plain = '"%s"' % _xxh3_hex(bytes(block))
    for r in range(files):
        w = bytearray(n)
        w[1::4096] = bytes([r + 1]) * len(range(1, n, 4096))
        w = full["w%d" % r] = bytes(w)
        write(os.path.join(d, "rank_%d.safetensors" % r), _st_bytes([("w%d" % r, "U8", [n], w)]))
        marked, per_page = '"%s"' % _xxh3_hex(w[:block]), 4096 // block
        tables[r] = '{"w%d": [' % r + ", ".join(marked if k % per_page == 0 else plain for k in range(blocks)) + "]}"
        if sidecar:
            write(os.path.join(d, "rank_%d.checksums.json" % r), tables[r].encode())
        specs.append('"w%d": {"shape": [%d], "is_sharded": false, "dtype": "U8", "shard_spec_per_file": '
                     '{"rank_%d.safetensors": {"flattened_offsets": [[0, %d]], "local_shape": null, '
                     '"global_offset": null}}}' % (r, n, r, n))
    files_json = "{}" if sidecar else "{" + ", ".join('"rank_%d.safetensors": %s' % (r, tables[r])
                                                      for r in range(files)) + "}"
    cs = '{"algorithm": "xxh3-64", "block_bytes": %d, %s"files": %s}' % (block, '"sidecars": true, ' if sidecar else "",
                                                                      files_json)
    write(os.path.join(d, "metadata.json"),
          ('{"tensors": {%s}, "shardsafe": {"checksums": %s}}' % (", ".join(specs), cs)).encode())
    return full


@case
def checksum_tables_at_limit(t):
    """Checksum tables of 2^20 hashes together (FORMAT.md §2, "Checksums"), 4-byte blocks of 4 MiB
    of tensors: one file's table, and four files' of 2^18 each, in sidecars and in metadata.json:
    every command reads and checks them within the limits, output checked, and a flipped byte is
    found. 2^20 + 1 hashes are refused by every command that reads them: sidecars by the count
    their files' headers make, before one is read (also one of 4 M hashes, 80 MB: the issue's
    600 MiB), tables in metadata.json as they are read; naming the file and the rule. (The old
    tool took them all; four sidecars of 2^20 each cost it 750 MiB.)"""
    for files, sidecar in ((1, True), (4, True), (1, False), (4, False)):
        name = "%d-%s" % (files, "sidecar" if sidecar else "inline")
        d = os.path.join(t, name)
        full = _hashed_checkpoint(d, files, MAX_HASHES // files, sidecar)
        _check_every_command("checksum_tables_at_limit", d, os.path.join(t, name + "-out"), full)
        last = files - 1  # one byte flipped in its last block: found (the table was read and used)
        with open(os.path.join(d, "rank_%d.safetensors" % last), "r+b") as f:
            f.seek(-1, 2)
            f.write(b"\x01")
        run("checksum_tables_at_limit", ["verify", d], 1,
            ["rank_%d.safetensors" % last, "'w%d'" % last, "block %d" % (MAX_HASHES // files - 1)])
        shutil.rmtree(d)
    for name, files, blocks, sidecar in (("sidecar-past", 2, MAX_HASHES // 2 + 1, True),
                                         ("sidecar-4m", 1, 4 << 20, True),
                                         ("inline-past", 2, MAX_HASHES // 2 + 1, False)):
        d = os.path.join(t, name)
        _hashed_checkpoint(d, files, blocks, sidecar)
        holder = "checksums.json" if sidecar else "metadata.json"
        for cmd in ("verify", "digest") + _OUTPUTS:
            argv = [cmd, d]
            if cmd in _OUTPUTS:
                argv.append(os.path.join(t, "out-" + cmd + (".safetensors" if cmd == "unshard" else "")))
            run("checksum_tables_at_limit", argv, 1, [holder, f"more than the {MAX_HASHES}" if sidecar else
                                                       f"more than {MAX_HASHES} hashes", "checksum tables"])
            if cmd in _OUTPUTS and _written(argv[-1]):
                raise Failed(f"{cmd} wrote {argv[-1]} though it refused")
        if not sidecar:
            run("checksum_tables_at_limit", ["inspect", d], 1, [holder, f"more than {MAX_HASHES} hashes"])
        shutil.rmtree(d)
