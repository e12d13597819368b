# tests/grid_expand.py - an independent reading of metadata.json's compact form (docs/FORMAT.md
# §2, "The compact form"), written from the format text alone, for test_mesh.cpp.
#
#   python3 -I grid_expand.py LISTED_DIR COMPACT_DIR
#
# The two folders hold the same views saved twice, in the listed and the compact form. For every
# tensor, the compact folder's "shardsafe_grid" is expanded by the format's rule (piece i of a
# dimension of n elements cut in chunks of c: [min(n, c*i), min(n, c*(i+1))); part (i_0, ...)
# held by rank base + sum(i_d * strides[d]); every part listed, in rank order) and must equal the
# listed folder's "shard_spec_per_file" exactly; a tensor without a grid must be listed alike.
# The compact folder's checksums must be kept beside its rank files, each rank_R.checksums.json
# equal to the listed folder's table for rank_R.safetensors. Prints one line: the grids seen.
import itertools
import json
import os
import sys


def load(path):
    with open(path, "rb") as f:
        return json.loads(f.read().decode("ascii"), object_pairs_hook=lambda kv: kv)


def as_dict(pairs):
    d = dict(pairs)
    assert len(d) == len(pairs), "a key is given twice"
    return d


def expand(tensor):
    g = as_dict(tensor["shardsafe_grid"])
    shape = tensor["shape"]
    numel = 1
    for n in shape:
        numel *= n
    dims = [numel] if g["flat"] else list(shape)
    assert len(g["chunks"]) == len(g["parts"]) == len(g["strides"]) == len(dims)
    parts = []
    for index in itertools.product(*[range(p) for p in g["parts"]]):
        rank = g["base"] + sum(i * s for i, s in zip(index, g["strides"]))
        pieces = [(min(n, c * i), min(n, c * (i + 1))) for n, c, i in zip(dims, g["chunks"], index)]
        if g["flat"]:
            spec = [("flattened_offsets", [[pieces[0][0], pieces[0][1]]]), ("local_shape", None), ("global_offset", None)]
        else:
            spec = [("flattened_offsets", None), ("local_shape", [e - b for b, e in pieces]),
                    ("global_offset", [b for b, e in pieces])]
        parts.append((rank, ("rank_%d.safetensors" % rank, spec)))
    ranks = [r for r, _ in parts]
    assert len(set(ranks)) == len(ranks), "two parts have one rank"
    return [p for _, p in sorted(parts)]


def main():
    listed_dir, compact_dir = sys.argv[1], sys.argv[2]
    listed = as_dict(load(os.path.join(listed_dir, "metadata.json")))
    compact = as_dict(load(os.path.join(compact_dir, "metadata.json")))
    lt, ct = as_dict(listed["tensors"]), as_dict(compact["tensors"])
    assert list(lt) == list(ct), "the tensors differ"
    grids = []
    for key in lt:
        want, got = as_dict(lt[key]), as_dict(ct[key])
        for field in ("shape", "dtype", "is_sharded"):
            assert want[field] == got[field], (key, field)
        assert "shardsafe_grid" not in want, key
        if "shardsafe_grid" in got:
            assert "shard_spec_per_file" not in got, key
            assert expand(got) == want["shard_spec_per_file"], (key, expand(got), want["shard_spec_per_file"])
            grids.append(key)
        else:
            assert got["shard_spec_per_file"] == want["shard_spec_per_file"], key
    ls, cs = as_dict(as_dict(listed["shardsafe"])["checksums"]), as_dict(as_dict(compact["shardsafe"])["checksums"])
    assert cs["sidecars"] is True and cs["files"] == [] and "sidecars" not in ls
    for fname, table in as_dict(ls["files"]).items():
        side = load(os.path.join(compact_dir, fname[: -len(".safetensors")] + ".checksums.json"))
        assert side == table, fname
    print("grids: " + " ".join(grids))


main()
