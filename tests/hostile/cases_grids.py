"""Hostile cases of metadata.json's compact form (docs/FORMAT.md §2, "The compact form"; issue 53):
a grid of a few numbers stands for up to 2^20 parts per tensor and 2^26 per file, and no command
may pay for them as a list. Loaded by hostile.py, with its helpers (run, case, write,
safetensors_bytes, ...) in scope."""
import hashlib
import json
import os
import struct

MAX_PARTS = 1 << 20        # per tensor (max_grid_parts)
MAX_PARTS_TOTAL = 1 << 26  # per file (max_grid_parts_total)


def _grid_tensor(shape, flat, chunks, parts, strides, base=0, dtype="U8"):
    return {"shape": list(shape), "is_sharded": True, "dtype": dtype,
            "shardsafe_grid": {"flat": flat, "chunks": list(chunks), "parts": list(parts), "base": base,
                               "strides": list(strides)}}


def _every_command(case_name, d, outs, name, code, words):
    """inspect exits 0 (it reads no rank file the writer did not record); verify, digest, unshard,
    to-hf and to-dcp exit `code` with `words`, and a refusal leaves no output under outs."""
    run(case_name, ["inspect", d], 0)
    for argv in (["verify", d], ["digest", d], ["unshard", d, os.path.join(outs, name + ".safetensors")],
                 ["to-hf", d, os.path.join(outs, name + "-hf")], ["to-dcp", d, os.path.join(outs, name + "-dcp")]):
        run(case_name, argv, code, words)
    for left in (name + ".safetensors", name + "-hf", name + "-dcp"):
        p = os.path.join(outs, left)
        if os.path.exists(p) and (os.path.isfile(p) or os.listdir(p)):
            raise Failed(f"{name}: {left} was written though the command refused")


@case
def grid_million_parts(t):
    """A metadata.json of under 300 bytes whose one U8 tensor is a grid of 2^20 parts (flat; and
    a [1024, 1024] block grid whose ranks run down the columns): inspect lists it (the first four
    files, the count) and every other command refuses it for its first missing rank file, in rank
    order (rank_0, or rank_1 where rank_0 is there), without expanding the grid first."""
    outs = os.path.join(t, "out")
    os.makedirs(outs)
    for name, tensor in (
            ("flat", _grid_tensor([MAX_PARTS], True, [1], [MAX_PARTS], [1])),
            ("block", _grid_tensor([1024, 1024], False, [1, 1], [1024, 1024], [1, 1024]))):
        d = os.path.join(t, name)
        write(os.path.join(d, "metadata.json"), json.dumps({"tensors": {"w": tensor}}).encode())
        if os.path.getsize(os.path.join(d, "metadata.json")) > 300:
            raise Failed(f"{name}: the metadata.json is not small")
        out, _ = run("grid_million_parts", ["inspect", d], 0)
        if "rank_0.safetensors,rank_1.safetensors,rank_2.safetensors,rank_3.safetensors,..." not in out or \
                f"over {MAX_PARTS} file(s), a grid" not in out:
            raise Failed(f"{name}: inspect does not list the grid's first files and count: {out[-400:]}")
        _every_command("grid_million_parts", d, outs, name, 1, ["rank_0.safetensors", "missing"])
        # rank 0 there, holding its part: the next rank in order is the one named
        part = [("w", "U8", [1] if name == "flat" else [1, 1], b"\x07")]
        write(os.path.join(d, "rank_0.safetensors"), safetensors_bytes(part))
        _every_command("grid_million_parts", d, outs, name + "-r0", 1, ["rank_1.safetensors", "missing"])


@case
def grid_total_parts(t):
    """A 10 KB metadata.json of 64 U8 tensors, each a grid of 2^20 parts: 2^26 parts together,
    the limit of one file. inspect lists them, every other command refuses the first missing rank
    file at once (to-hf used 6.8 GB here). One tensor more passes the limit: every command
    refuses the file, naming the rule."""
    outs = os.path.join(t, "out")
    os.makedirs(outs)
    grid = _grid_tensor([MAX_PARTS], True, [1], [MAX_PARTS], [1])
    tensors = {"w%02d" % i: grid for i in range(MAX_PARTS_TOTAL // MAX_PARTS)}
    d = os.path.join(t, "at_limit")
    write(os.path.join(d, "metadata.json"), json.dumps({"tensors": tensors}).encode())
    out, _ = run("grid_total_parts", ["inspect", d], 0)
    if out.count(f"over {MAX_PARTS} file(s), a grid") != len(tensors):
        raise Failed(f"inspect does not list the {len(tensors)} grids: {out[-400:]}")
    _every_command("grid_total_parts", d, outs, "at_limit", 1, ["rank_0.safetensors", "missing"])
    tensors["x"] = _grid_tensor([2], True, [1], [2], [1])
    d = os.path.join(t, "past_limit")
    write(os.path.join(d, "metadata.json"), json.dumps({"tensors": tensors}).encode())
    for argv in (["inspect", d], ["verify", d], ["digest", d], ["unshard", d, os.path.join(outs, "p.safetensors")],
                 ["to-hf", d, os.path.join(outs, "p-hf")], ["to-dcp", d, os.path.join(outs, "p-dcp")]):
        run("grid_total_parts", argv, 1, ["metadata.json", "tensor 'x'", f"more than {MAX_PARTS_TOTAL} parts"])


def _st_header_bytes(entries):
    """A safetensors file of 1-byte U8 tensors: entries [(name, shape, byte)], in that order."""
    header, data = {}, b""
    for i, (name, shape, value) in enumerate(entries):
        header[name] = {"dtype": "U8", "shape": shape, "data_offsets": [i, i + 1]}
        data += bytes([value])
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + data


def _read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
            for k, v in header.items()}


@case
def grid_valid_65536_ranks(t):
    """A valid compact checkpoint of 65,536 ranks, each file holding one byte of three U8
    tensors: w [65536] a flat grid, m [256, 256] a block grid in row-major rank order, c [256, 256]
    one whose ranks run down the columns (strides [1, 256]). Every command succeeds within the
    limits, and the bytes are the ones written: digest's hashes, unshard's and to-hf's tensors,
    to-dcp's folder digested again, all against the full tensors built here."""
    ranks, side = 1 << 16, 256
    full = {
        "w": bytes((r * 7 + 3) % 256 for r in range(ranks)),
        "m": bytes((i * 31 + j * 17) % 251 for i in range(side) for j in range(side)),
        "c": bytes((i * 13 + j * 5 + 1) % 256 for i in range(side) for j in range(side)),
    }
    d = os.path.join(t, "ckpt")
    os.makedirs(d)
    for r in range(ranks):
        i, j = divmod(r, side)  # m: rank i * 256 + j holds (i, j); c: rank j * 256 + i holds (i, j)
        with open(os.path.join(d, "rank_%d.safetensors" % r), "wb") as f:
            f.write(_st_header_bytes([("w", [1], full["w"][r]), ("m", [1, 1], full["m"][r]),
                                      ("c", [1, 1], full["c"][j * side + i])]))
    md = {"tensors": {
        "w": _grid_tensor([ranks], True, [1], [ranks], [1]),
        "m": _grid_tensor([side, side], False, [1, 1], [side, side], [side, 1]),
        "c": _grid_tensor([side, side], False, [1, 1], [side, side], [1, side]),
    }, "shardsafe": {"writer": "hostile.py", "world_size": ranks}}
    write(os.path.join(d, "metadata.json"), json.dumps(md).encode())
    shapes = {"w": [ranks], "m": [side, side], "c": [side, side]}

    out, _ = run("grid_valid_65536_ranks", ["inspect", d], 0)
    if out.count(f"over {ranks} file(s), a grid") != 3:
        raise Failed(f"inspect: {out[-600:]}")
    out, _ = run("grid_valid_65536_ranks", ["verify", d], 0)
    if ": 3 tensors valid" not in out:
        raise Failed(f"verify: {out}")
    out, _ = run("grid_valid_65536_ranks", ["digest", d], 0)
    want = sorted("%s U8 [%s] %s" % (k, ",".join(map(str, shapes[k])), hashlib.sha256(v).hexdigest())
                  for k, v in full.items())
    if out.split("\n")[:-1] != want:
        raise Failed(f"digest: {out!r}, expected {want!r}")
    outs = os.path.join(t, "out")
    os.makedirs(outs)
    one = os.path.join(outs, "all.safetensors")
    run("grid_valid_65536_ranks", ["unshard", d, one], 0)
    hf = os.path.join(outs, "hf")
    run("grid_valid_65536_ranks", ["to-hf", d, hf], 0)
    for path in (one, os.path.join(hf, "model.safetensors")):
        got = _read_safetensors(path)
        if got != {k: ("U8", shapes[k], v) for k, v in full.items()}:
            raise Failed(f"{path}: tensors differ from those written")
    dcp = os.path.join(outs, "dcp")
    run("grid_valid_65536_ranks", ["to-dcp", d, dcp], 0)
    out, _ = run("grid_valid_65536_ranks", ["digest", dcp], 0)
    if out.split("\n")[:-1] != want:
        raise Failed(f"digest of the DCP export: {out!r}, expected {want!r}")
