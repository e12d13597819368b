"""Import before `import torch` in the scripts the tests and benchmarks run with Debian's torch
1.13 (/usr/bin/python3, Python 3.11).

torch 1.13 declares dataclass fields whose defaults are unhashable instances (TensorProperties'
dtype, layout and memory_format, among others); Python 3.11 refuses those ("mutable default").
This turns such a default into a default_factory returning the same value, before torch is
imported. On interpreters that accept the defaults it changes nothing; `used` says whether it
was needed.
"""
import dataclasses

used = False
_orig_get_field = dataclasses._get_field


def _get_field(cls, name, type_, *rest):
    global used
    try:
        return _orig_get_field(cls, name, type_, *rest)
    except ValueError as e:
        if "mutable default" not in str(e):
            raise
        used = True
        f = cls.__dict__[name]
        value = f.default if isinstance(f, dataclasses.Field) else f
        if isinstance(f, dataclasses.Field):
            f.default = dataclasses.MISSING
            f.default_factory = lambda v=value: v
        else:
            setattr(cls, name, dataclasses.field(default_factory=lambda v=value: v))
        return _orig_get_field(cls, name, type_, *rest)


dataclasses._get_field = _get_field
