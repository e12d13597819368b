#!/usr/bin/env python3
"""The Python routes bench/bench_quant.cpp measures shardsafe against: a quantized checkpoint's
weights into BF16 (issue 55), as the Python tools do it.

    python3 quant_peer.py version
    python3 quant_peer.py whole CKPT_DIR SCHEME          every weight whole: safetensors' load_file,
                                                        then the dequantization in torch
                                                        (DeepSeek-V3's fp8_cast_bf16.py route)
    python3 quant_peer.py rows CKPT_DIR SCHEME R N      rank R of N: its block of rows of every
                                                        weight through safe_open's get_slice (the
                                                        rows' bytes and their scales only), then
                                                        the same dequantization

SCHEME: fp8_block (F8_E4M3 + weight_scale_inv per 128 x 128) or mxfp4 (X_blocks + X_scales, gpt-oss).
Prints one line "seconds=S values=V checksum=C": S the work's wall seconds (imports and the
checksum excluded), V the BF16 values made, C their sum (the values checked against shardsafe's). Exits 77 when
torch has no float8_e4m3fn or safetensors is missing.
"""
import os
import sys
import time

try:
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file
except ImportError as e:
    print(f"skipped: {e}")
    sys.exit(77)
if not hasattr(torch, "float8_e4m3fn"):
    print(f"skipped: torch {torch.__version__} has no float8_e4m3fn")
    sys.exit(77)

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def fp8(w, s):
    """DeepSeek-V3's weight_dequant, in torch: w.float() times its block's scale, then BF16."""
    se = s.repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :w.shape[1]]
    return (w.float() * se).to(torch.bfloat16)


def mxfp4(blocks, scales):
    """gpt-oss's convert_moe_packed_tensors: the E2M1 table, then ldexp by the E8M0 exponent."""
    lo = E2M1[(blocks & 0x0F).long()]
    hi = E2M1[(blocks >> 4).long()]
    v = torch.stack([lo, hi], dim=-1).reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)
    e = (scales.to(torch.int32) - 127).repeat_interleave(32, -1)
    return torch.ldexp(v, e).to(torch.bfloat16)


def main():
    if sys.argv[1] == "version":
        print(torch.__version__)
        return
    mode, ckpt, scheme = sys.argv[1], sys.argv[2], sys.argv[3]
    path = os.path.join(ckpt, "model.safetensors")
    t0 = time.perf_counter()
    out = []
    if mode == "whole":
        t = load_file(path)
        if scheme == "fp8_block":
            out = [fp8(w, t[k + "_scale_inv"]) for k, w in t.items() if w.dtype == torch.float8_e4m3fn]
        else:
            out = [mxfp4(b, t[k[:-7] + "_scales"]) for k, b in t.items() if k.endswith("_blocks")]
    else:
        r, n = int(sys.argv[4]), int(sys.argv[5])
        with safe_open(path, framework="pt") as f:
            for k in f.keys():
                if scheme == "fp8_block" and not k.endswith("_scale_inv"):
                    rows = f.get_slice(k).get_shape()[0]
                    per = -(-rows // n)
                    a, e = min(rows, r * per), min(rows, (r + 1) * per)
                    w = f.get_slice(k)[a:e]
                    s = f.get_slice(k + "_scale_inv")[a // 128:-(-e // 128)]
                    se = s.repeat_interleave(128, 0)[a % 128:a % 128 + (e - a)].repeat_interleave(128, 1)[:, :w.shape[1]]
                    out.append((w.float() * se).to(torch.bfloat16))
                elif scheme == "mxfp4" and k.endswith("_blocks"):
                    shape = f.get_slice(k).get_shape()
                    rows = shape[-3]
                    per = -(-rows // n)
                    a, e = min(rows, r * per), min(rows, (r + 1) * per)
                    b = f.get_slice(k)[:, a:e]
                    s = f.get_slice(k[:-7] + "_scales")[:, a:e]
                    out.append(mxfp4(b, s))
    seconds = time.perf_counter() - t0
    values = sum(x.numel() for x in out)
    checksum = float(sum(x.double().sum() for x in out)) if out else 0.0
    print(f"seconds={seconds:.6f} values={values} checksum={checksum:.6g}")


if __name__ == "__main__":
    main()
