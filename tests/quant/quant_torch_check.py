#!/usr/bin/env python3
"""The quantized goldens' expected values (tests/fixtures/quant/*/expected/, written by
make_quant_goldens.py from the formats' definitions) against torch's own arithmetic: torch's
float8_e4m3fn conversion for E4M3 (and its bfloat16 for compressed-tensors' scales), gpt-oss's own route for MXFP4 (a 16-entry table of E2M1 values,
then ldexp by the E8M0 exponent), and each scale multiplied in F32 as the Python tools do.

    python3 tests/quant/quant_torch_check.py [tests/fixtures/quant]

Every F32 value must equal the golden bit for bit (each product is exact or rounded once in F32,
as the golden rounds it). BF16: torch's route rounds the F32 product again; the golden rounds the
exact value once; the two may differ in the last bit where the F32 product is a BF16 tie: the
count is printed (it is the difference a user sees between shardsafe and `w.float() * s).bfloat16()`).

With torch 2.8 or later (float8_e8m0fnu, float4_e2m1fn_x2), the E8M0 scales and packed FP4 bytes
are also read as torch's own dtypes and must give the same values (the lent GPU machine's check).
Needs torch with float8_e4m3fn (2.1 or later); exits 77 (skipped) under an older torch.
"""
import json
import os
import struct
import sys

import torch

if not hasattr(torch, "float8_e4m3fn"):
    print(f"skipped: torch {torch.__version__} has no float8_e4m3fn")
    sys.exit(77)


def read(path):
    """{name: (dtype, shape, uint8 tensor of the bytes)}; any dtype (F8_E8M0 too), no safetensors."""
    with open(path, "rb") as f:
        b = f.read()
    (n,) = struct.unpack("<Q", b[:8])
    h = json.loads(b[8:8 + n])
    data = bytearray(b[8 + n:])
    out = {}
    for k, v in h.items():
        if k == "__metadata__":
            continue
        lo, hi = v["data_offsets"]
        out[k] = (v["dtype"], tuple(v["shape"]), torch.frombuffer(data, dtype=torch.uint8, offset=lo, count=hi - lo)
                  if hi > lo else torch.zeros(0, dtype=torch.uint8))
    return out


def as_dtype(raw, dtype, shape):
    return raw.view(dtype).reshape(shape)


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def unpack_fp4(packed, logical_shape):
    """gpt-oss's route: low nibble first, each code through the E2M1 table (F32)."""
    lo = E2M1[(packed & 0x0F).long()]
    hi = E2M1[(packed >> 4).long()]
    return torch.stack([lo, hi], dim=-1).reshape(logical_shape)


def e8m0_exp(raw):
    return raw.to(torch.int32) - 127


def dequant(case, t):
    """{logical name: F32 tensor} by torch's arithmetic."""
    out = {}
    for name, (dt, shape, raw) in t.items():
        if case == "fp8_block" and dt == "F8_E4M3":
            w = as_dtype(raw, torch.float8_e4m3fn, shape).float()
            s = as_dtype(t[name + "_scale_inv"][2], torch.float32, t[name + "_scale_inv"][1])
            se = s.repeat_interleave(128, 0)[:shape[0]].repeat_interleave(128, 1)[:, :shape[1]]
            out[name] = w * se  # DeepSeek-V3's weight_dequant
        elif case == "fp8_channel" and dt == "F8_E4M3":
            w = as_dtype(raw, torch.float8_e4m3fn, shape).float()
            sdt, sshape, sraw = t[name[:-len("weight")] + "weight_scale"]
            s = as_dtype(sraw, {"BF16": torch.bfloat16, "F32": torch.float32}[sdt], sshape).float()
            # compressed-tensors' and FBGEMM's weight * weight_scale, a scale a row or one, in F32
            out[name] = w * (s.reshape(-1, 1) if s.numel() > 1 else s.reshape(()))
        elif case == "mxfp8" and dt == "F8_E4M3":
            w = as_dtype(raw, torch.float8_e4m3fn, shape).float()
            sc = t[name[:-len("weight")] + "weight_scale"]
            e = e8m0_exp(sc[2]).reshape(sc[1]).repeat_interleave(32, -1)
            out[name] = torch.ldexp(w, e)
            if hasattr(torch, "float8_e8m0fnu"):  # torch's own E8M0
                s = sc[2].view(torch.float8_e8m0fnu).float().reshape(sc[1]).repeat_interleave(32, -1)
                assert torch.equal(w * s, out[name]), f"{case} {name}: float8_e8m0fnu differs from ldexp"
        elif case == "mxfp4" and name.endswith("_blocks"):
            stem = name[:-len("_blocks")]
            logical = shape[:-2] + (shape[-2] * 32,)
            v = unpack_fp4(raw.reshape(shape), logical)
            sc = t[stem + "_scales"]
            e = e8m0_exp(sc[2]).reshape(sc[1]).repeat_interleave(32, -1)
            out[stem] = torch.ldexp(v, e)  # gpt-oss's convert_moe_packed_tensors, in F32
        elif case == "nvfp4" and dt == "U8":
            stem = name[:-len("weight")]
            logical = shape[:-1] + (shape[-1] * 2,)
            v = unpack_fp4(raw.reshape(shape), logical)
            sc = t[stem + "weight_scale"]
            s = as_dtype(sc[2], torch.float8_e4m3fn, sc[1]).float().repeat_interleave(16, -1)
            g = as_dtype(t[stem + "weight_scale_2"][2], torch.float32, ())
            out[name] = (v * s) * g  # v * s is exact in F32; one rounding by g
            if hasattr(torch, "float4_e2m1fn_x2"):  # torch's own packed FP4: the same bytes
                assert raw.view(torch.float4_e2m1fn_x2).numel() == raw.numel()
    return out


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                              "fixtures", "quant")
    bad = []
    for case in ("fp8_block", "mxfp4", "mxfp8", "nvfp4", "fp8_channel"):
        t = read(os.path.join(root, case, "model.safetensors"))
        got = dequant(case, t)
        f32 = read(os.path.join(root, case, "expected", "f32.safetensors"))
        bf16 = read(os.path.join(root, case, "expected", "bf16.safetensors"))
        if set(got) != set(f32):
            bad.append(f"{case}: torch dequantized {sorted(got)}, the golden has {sorted(f32)}")
            continue
        ties = 0
        for name, y in got.items():
            want = as_dtype(f32[name][2], torch.float32, f32[name][1])
            if not torch.equal(y.view(torch.int32), want.view(torch.int32)):
                n = int((y.view(torch.int32) != want.view(torch.int32)).sum())
                bad.append(f"{case} {name}: {n} F32 values differ from torch's")
            wb = as_dtype(bf16[name][2], torch.bfloat16, bf16[name][1])
            ties += int((y.bfloat16().view(torch.int16) != wb.view(torch.int16)).sum())
        print(f"ok {case}: {len(got)} tensors' F32 values equal torch {torch.__version__}'s dequantization bit for "
              f"bit; BF16: {ties} values where torch's F32-then-BF16 route rounds twice")
    for b in bad:
        print("FAILED", b)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
