#!/usr/bin/env python3
"""The tool on the quantized goldens (issue 55; tests/fixtures/quant/, values from
make_quant_goldens.py): `to-hf --dequantize` writes each quantized weight under its logical name
as its values (BF16, or F32 with --dtype f32), bit for bit the golden's expected/, its scales left
out and every other tensor as stored; `to-hf` without it writes every stored tensor as it is;
`inspect` names each weight with its scheme and scales, `verify` counts them.

    python3 tests/quant/quant_tool_check.py TOOL [tests/fixtures/quant]

Plain Python (no torch).
"""
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peers"))
from golden_check import read_safetensors, run  # noqa: E402

CASES = {"fp8_block": 3, "mxfp4": 2, "mxfp8": 1, "nvfp4": 2, "fp8_channel": 5}
SCHEMES = {"fp8_channel": ("fp8_channel", "fp8_tensor")}  # the folder's weights per channel and per tensor


def main():
    tool = sys.argv[1]
    root = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                              "fixtures", "quant")
    bad = []
    with tempfile.TemporaryDirectory() as tmp:
        for case, n in CASES.items():
            src = os.path.join(root, case)
            stored = read_safetensors(os.path.join(src, "model.safetensors"))
            ok = subprocess.run([tool, "verify", src], capture_output=True, text=True)
            if f"{n} quantized weight" not in ok.stdout:
                bad.append(f"{case}: verify does not count {n} quantized weights: {ok.stdout.strip()}")
            listing = subprocess.run([tool, "inspect", src], capture_output=True, text=True).stdout
            if sum(listing.count(f"quantized {s} weight") for s in SCHEMES.get(case, (case,))) != n:
                bad.append(f"{case}: inspect does not name {n} quantized weights")
            for dtype, kind in (("bf16", "bf16"), ("f32", "f32")):
                out = os.path.join(tmp, f"{case}-{dtype}")
                run(tool, "to-hf", src, out, "--dequantize", "--dtype", dtype)
                got = read_safetensors(os.path.join(out, "model.safetensors"))
                want = read_safetensors(os.path.join(src, "expected", f"{kind}.safetensors"))
                for name, t in want.items():
                    if got.get(name) != t:
                        bad.append(f"{case} --dtype {dtype}: '{name}' is not the golden's values")
                scales = [k for k in got if "_scale" in k and not k.endswith("input_scale") or k.endswith("_blocks")]
                if scales:
                    bad.append(f"{case} --dequantize: scales or blocks written: {scales}")
                # the others as stored (a plain BF16 or F32 tensor converted by --dtype, as to-hf does)
                for name, t in got.items():
                    if name in want or name not in stored:
                        continue
                    if stored[name][0] == t[0] and stored[name] != t:
                        bad.append(f"{case}: '{name}' changed")
            raw = os.path.join(tmp, f"{case}-raw")
            run(tool, "to-hf", src, raw)
            got = read_safetensors(os.path.join(raw, "model.safetensors"))
            if got != stored:
                bad.append(f"{case}: to-hf without --dequantize did not write the stored tensors as they are")
            if not bad:
                print(f"ok {case}: to-hf --dequantize gives the golden's BF16 and F32 values of {n} weights, "
                      f"scales left out; without it, every stored tensor as it is; inspect and verify name them")
    for b in bad:
        print("FAILED", b)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
