"""Hostile cases of a DCP folder's `.metadata` at and past its limits (docs/FORMAT.md §5; issue
53): at most 24 MiB of pickle, 2^17 chunks over all tensors, 3 x 2^20 values made by its
reader and 6 x 2^20 as a tree. A folder at the chunk limit, its `.metadata` pickled as torch pickles it (Python's own
pickler, every object memoized) and its data file holding one torch.save archive per chunk, is
read by every command within the suite's limits, the bytes checked against those built here;
one chunk, one value or one byte past a limit is refused by every command naming the rule. The
old tool read `.metadata` files of up to 1 GiB (15 MB of 120,000 chunks: 210 MiB) and accepted
every one of these. Loaded by hostile.py, with its helpers (run, case, Failed, write,
torch_like_metadata, dcp_f32_archive, command_argv, refused_by_all, ...) in scope."""
import hashlib
import json
import os
import shutil
import struct

MAX_CHUNKS = 1 << 17          # max_dcp_chunks
MAX_PER_TENSOR = 1 << 16      # max_dcp_chunks_per_tensor
MAX_MADE = 3 << 20            # max_dcp_metadata_made
MAX_VALUES = 6 << 20          # max_dcp_metadata_values
MAX_DCP_METADATA = 24 << 20   # max_dcp_metadata_size
def _write_in_child(path, make):
    """write(path, make()) in a forked child: the values a large pickle is made from never count in
    the tool's peak RSS (a child forked by `run` starts with this process's pages)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            write(path, make())
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise Failed("could not build " + path)


@case
def dcp_metadata_limits(t):
    """Two F32 [65536, 4] tensors of 65,536 one-row chunks each (2^17 chunks, the limit; 2.75 M
    values in a 17 MB `.metadata`): every command exits 0 within the limits, digest's lines and
    unshard's bytes as computed here. Then a third tensor of one chunk (2^17 + 1 chunks), a
    planner_data of 3 x 2^20 empty lists (in 10 MB), one of 12.6 M references to one int (24 MiB),
    and a 25 MB string: refused by every command, naming `.metadata` and the rule, no output
    written."""
    outs = os.path.join(t, "out")
    os.makedirs(outs)
    d = os.path.join(t, "dcp")
    os.makedirs(d)
    rows = MAX_PER_TENSOR
    values = {fqn: [float((r * 4 + j) % 1000 + k) for r in range(rows) for j in range(4)]
              for k, fqn in enumerate(("a", "b"))}
    full = {fqn: struct.pack(f"<{len(v)}f", *v) for fqn, v in values.items()}
    archive = dcp_f32_archive([1, 4], [4, 1], [0.0] * 4)  # every chunk's archive is this long
    places = {(fqn, c): ((k * rows + c) * len(archive), len(archive)) for k, fqn in enumerate(("a", "b"))
              for c in range(rows)}
    with open(os.path.join(d, "__0_0.distcp"), "wb") as f:
        for fqn in ("a", "b"):
            for c in range(rows):
                a = dcp_f32_archive([1, 4], [4, 1], values[fqn][c * 4:c * 4 + 4])
                if len(a) != len(archive):
                    raise Failed("archives of one length expected")
                f.write(a)
    del values
    tensors = [("a", rows, rows), ("b", rows, rows)]
    _write_in_child(os.path.join(d, ".metadata"), lambda: torch_like_metadata(tensors, places=places))
    for cmd in ALL_COMMANDS:
        out, _ = run("dcp_metadata_limits", command_argv(cmd, d, outs), 0)
        if cmd == "digest":
            for fqn in ("a", "b"):
                line = f"{fqn} F32 [{rows},4] {hashlib.sha256(full[fqn]).hexdigest()}"
                if line not in out:
                    raise Failed("digest does not say " + line + ": " + out[:400])
    with open(os.path.join(outs, "u.safetensors"), "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    for fqn in ("a", "b"):
        b, e = header[fqn]["data_offsets"]
        if raw[8 + n + b:8 + n + e] != full[fqn]:
            raise Failed(f"unshard wrote other bytes for {fqn}")
    for p in os.listdir(outs):
        shutil.rmtree(os.path.join(outs, p)) if os.path.isdir(os.path.join(outs, p)) else os.remove(os.path.join(outs, p))

    # one chunk more (the third tensor's data is never reached)
    places[("c", 0)] = (0, places[("a", 0)][1])
    write(os.path.join(d, ".metadata"), torch_like_metadata(tensors + [("c", 1, 1)], places=places))
    refused_by_all("dcp_metadata_limits", d, outs, [".metadata", "'c'", "131073", "131072"])
    # a small .metadata whose reader would make more values than the limit (lists, each a value made)
    _write_in_child(os.path.join(d, ".metadata"), lambda: torch_like_metadata(
        [("a", 1, 1)], places=places, planner_data={"x": [[] for _ in range(MAX_MADE)]}))
    if os.path.getsize(os.path.join(d, ".metadata")) > 16 << 20:
        raise Failed("the values' .metadata is not small")
    refused_by_all("dcp_metadata_limits", d, outs, [".metadata", "makes more than " + str(MAX_MADE)])
    # a .metadata of 24 MiB that is one list of 12.6 M references to one small int (an 8-byte slot
    # for each 2 bytes of pickle, made once): refused as its tree passes 6 x 2^20 values (and 1
    # per 8 bytes of the pickle, for strings), its slots within the limits
    _write_in_child(os.path.join(d, ".metadata"), lambda: torch_like_metadata(
        [("a", 1, 1)], places=places, planner_data={"x": [7] * int((MAX_DCP_METADATA - 8192) / 2.002)}))
    if not MAX_DCP_METADATA - 65536 < os.path.getsize(os.path.join(d, ".metadata")) <= MAX_DCP_METADATA:
        raise Failed("the slots' .metadata is not at the limit: %d bytes" % os.path.getsize(os.path.join(d, ".metadata")))
    refused_by_all("dcp_metadata_limits", d, outs,
                    [".metadata", "expands to more than 94"])  # 6 x 2^20 + its 25,165,xxx bytes / 8
    # a .metadata past 24 MiB
    _write_in_child(os.path.join(d, ".metadata"), lambda: torch_like_metadata(
        [("a", 1, 1)], places=places, planner_data={"x": ("p" * MAX_DCP_METADATA,)}))
    refused_by_all("dcp_metadata_limits", d, outs, [".metadata", "within its first " + str(MAX_DCP_METADATA)])
