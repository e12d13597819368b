"""Edits a torch.save archive's data.pkl in place, byte for byte, for the tests that make a
peer's file hostile or rename one of its keys (tests/hostile/cases_deepspeed.py,
tests/peers/deepspeed_layout_check.py): every record is copied as it is, stored, in order."""
import io
import zipfile


def patch_data_pkl(path, edits):
    """Rewrites the torch.save archive at path with its data.pkl's bytes edited: each (after, old,
    new) replaces `old` by `new` of the same length, the first `old` past the first `after`, or
    (after None) the one `old` the pickle holds, which must occur exactly once."""
    src = zipfile.ZipFile(path)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for n in src.namelist():
            data = src.read(n)
            if n.endswith("/data.pkl"):
                for after, old, new in edits:
                    assert len(old) == len(new), (old, new)
                    if after is None:
                        assert data.count(old) == 1, old
                        at = data.index(old)
                    else:
                        at = data.index(old, data.index(after))
                    data = data[:at] + new + data[at + len(old):]
            z.writestr(n, data)
    src.close()
    with open(path, "wb") as f:
        f.write(out.getvalue())
