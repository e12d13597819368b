"""Reads a torch.distributed.checkpoint folder with Python alone (no torch): pickle with stand-in
classes for torch's, zipfile for the torch.save archives (CRC-32 checked), each tensor's chunks
reassembled into its full row-major bytes (a chunk torch.save kept with other strides, channels_last
or transposed, gathered in row-major order first). The independent reader of the torch-free tests of
shardsafe's DCP writer (tests/checkpoint/test_dcp_write.cpp); the torch 2.x tests check the same folders
with torch itself.

    python3 tests/dcp_stub_read.py FOLDER

Prints one line per key, sorted: a tensor as `KEY DTYPE [SHAPE] SHA256 CHUNKS` (the full bytes'
SHA-256, the number of chunks), a non-tensor item as `KEY = repr(value)`; then `planner KEY
PATH` for each planner_data entry. Exits 1 naming what is wrong (a chunk outside its tensor, an
element no chunk holds, two chunks that disagree, an archive whose tensor is not the chunk).
"""
import hashlib
import io
import pickle
import struct
import sys
import zipfile

STORAGE = {"FloatStorage": ("F32", 4), "DoubleStorage": ("F64", 8), "HalfStorage": ("F16", 2),
           "BFloat16Storage": ("BF16", 2), "LongStorage": ("I64", 8), "IntStorage": ("I32", 4),
           "ShortStorage": ("I16", 2), "CharStorage": ("I8", 1), "ByteStorage": ("U8", 1), "BoolStorage": ("BOOL", 1)}
DTYPES = {"float32": ("F32", 4), "float64": ("F64", 8), "float16": ("F16", 2), "bfloat16": ("BF16", 2),
          "int64": ("I64", 8), "int32": ("I32", 4), "int16": ("I16", 2), "int8": ("I8", 1), "uint8": ("U8", 1),
          "bool": ("BOOL", 1), "uint16": ("U16", 2), "uint32": ("U32", 4), "uint64": ("U64", 8),
          "float8_e4m3fn": ("F8_E4M3", 1), "float8_e5m2": ("F8_E5M2", 1)}


def fail(msg):
    print("dcp_stub_read: " + msg)
    sys.exit(1)


class Obj:
    """A stand-in for a torch dataclass: BUILD fills its __dict__ (or __setstate__ its tuple)."""

    def __init__(self, *args):
        self.args = args

    def __setstate__(self, state):
        if isinstance(state, tuple):  # TensorProperties: (dtype, layout, requires_grad, mem_format, pin_memory)
            self.__dict__["state"] = state
        else:
            self.__dict__.update(state)


class Index(Obj):
    def key(self):
        off = self.__dict__.get("offset")
        return (self.fqn, None if off is None else tuple(off))


class Dtype:
    def __init__(self, name):
        self.name = name


class Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"):
            if name == "MetadataIndex":
                return Index
            if name == "_MEM_FORMAT_ENCODING":
                return lambda v: ("mem_format", v)
            return type(name, (Obj,), {})
        if module == "torch" and name == "Size":
            return tuple
        if module == "torch.serialization" and name == "_get_layout":
            return lambda s: ("layout", s)
        if module == "torch":
            return Dtype(name)
        if module.startswith("pathlib"):
            return lambda *parts: "/".join(parts)
        fail(f"the .metadata refers to {module}.{name}")


class TensorUnpickler(pickle.Unpickler):
    """data.pkl of one tensor: the storage's type and size, the tensor's size and stride."""

    def find_class(self, module, name):
        if (module, name) in (("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3")):
            return lambda storage, offset, size, stride, rg, hooks, dtype=None, *rest: {
                "storage": storage, "offset": offset, "size": tuple(size), "stride": tuple(stride), "dtype": dtype}
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module in ("torch", "torch.storage"):
            return name
        fail(f"data.pkl refers to {module}.{name}")

    def persistent_load(self, pid):
        kind, typ, key, where, numel = pid
        return {"type": typ, "key": key, "numel": numel}


def archive(folder, info):
    with open(f"{folder}/{info.relative_path}", "rb") as f:
        f.seek(info.offset)
        data = f.read(info.length)
    if len(data) != info.length:
        fail(f"{info.relative_path} [{info.offset}, +{info.length}) passes its end")
    z = zipfile.ZipFile(io.BytesIO(data))
    bad = z.testzip()
    if bad:
        fail(f"{info.relative_path}: record {bad} fails its CRC-32")
    return z


def main(folder):
    with open(f"{folder}/.metadata", "rb") as f:
        md = Unpickler(f).load()
    storage = {k.key(): v for k, v in md.storage_data.items()}
    lines = []
    for key, item in sorted(md.state_dict_metadata.items()):
        if type(item).__name__ == "BytesStorageMetadata":
            z = archive(folder, storage[(key, None)])
            pkl = [n for n in z.namelist() if n.endswith("/data.pkl")][0]
            lines.append(f"{key} = {pickle.loads(z.read(pkl))!r}")
            continue
        dt, item_size = DTYPES[item.properties.state[0].name]
        size = tuple(item.size)
        numel = 1
        for d in size:
            numel *= d
        full = bytearray(numel * item_size)
        seen = bytearray(numel)
        strides = [1] * len(size)
        for d in range(len(size) - 2, -1, -1):
            strides[d] = strides[d + 1] * size[d + 1]
        for c in item.chunks:
            off, sz = tuple(c.offsets), tuple(c.sizes)
            if len(off) != len(size) or any(o + s > n for o, s, n in zip(off, sz, size)):
                fail(f"{key}: chunk at {off} of {sz} passes {size}")
            z = archive(folder, storage[(key, off)])
            pkl = [n for n in z.namelist() if n.endswith("/data.pkl")][0]
            t = TensorUnpickler(io.BytesIO(z.read(pkl))).load()
            if t["size"] != sz or t["offset"] != 0:
                fail(f"{key}: the archive at {off} holds size {t['size']} at offset {t['offset']}, not the chunk's {sz}")
            typ = t["dtype"] or t["storage"]["type"]
            got = STORAGE[typ][0] if typ in STORAGE else DTYPES[typ.name][0]
            if got != dt:
                fail(f"{key}: the archive at {off} holds {got}, .metadata says {dt}")
            rec = z.read(pkl[: -len("data.pkl")] + "data/" + t["storage"]["key"])
            n = 1
            for s in sz:
                n *= s
            if len(rec) != n * item_size:
                fail(f"{key}: the archive at {off} holds {len(rec)} bytes, the chunk {n * item_size}")
            if n == 0:
                continue
            rm = [1] * len(sz)
            for d in range(len(sz) - 2, -1, -1):
                rm[d] = rm[d + 1] * sz[d + 1]
            st = t["stride"]
            if any(s > 1 and a != b for s, a, b in zip(sz, st, rm)):
                # torch.save kept the tensor's strides (channels_last, transposed): gathered row-major
                if sum((s - 1) * a for s, a in zip(sz, st)) >= n:
                    fail(f"{key}: the archive at {off} has stride {st} past its {n} elements")
                out = bytearray(len(rec))
                for k in range(n):
                    at = sum((k // rm[d]) % sz[d] * st[d] for d in range(len(sz)))
                    out[k * item_size:(k + 1) * item_size] = rec[at * item_size:(at + 1) * item_size]
                rec = bytes(out)
            # every row (all dimensions but the last) of the chunk, copied to its place
            inner = sz[-1] if sz else 1
            rows = n // inner
            for r in range(rows):
                idx, rem = [], r
                for d in range(len(sz) - 2, -1, -1):
                    idx.append(rem % sz[d])
                    rem //= sz[d]
                idx.reverse()
                start = sum((o + i) * st for o, i, st in zip(off[:-1], idx, strides[:-1])) + (off[-1] if sz else 0)
                piece = rec[r * inner * item_size:(r + 1) * inner * item_size]
                for e in range(inner):
                    if seen[start + e] and full[(start + e) * item_size:(start + e + 1) * item_size] != \
                            piece[e * item_size:(e + 1) * item_size]:
                        fail(f"{key}: two chunks disagree at element {start + e}")
                    seen[start + e] = 1
                full[start * item_size:(start + inner) * item_size] = piece
        if numel and not all(seen):
            fail(f"{key}: element {seen.index(0)} is in no chunk")
        shape = "[" + ",".join(str(d) for d in size) + "]"
        lines.append(f"{key} {dt} {shape} {hashlib.sha256(bytes(full)).hexdigest()} {len(item.chunks)}")
    for key, path in sorted((md.planner_data or {}).items()):
        lines.append(f"planner {key} {path!r}")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1])
