#!/usr/bin/env python3
"""The quantized-weight goldens of tests/fixtures/quant/ and their expected values (issue 55),
written by plain Python from the formats' own definitions, not from shardsafe's code:

  - OCP Microscaling Formats (MX) v1.0: E8M0 scales (2^(v - 127), 0xFF NaN), FP4 E2M1 elements
    (sign, 2 exponent bits with bias 1, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6), blocks of 32;
  - the FP8 formats paper / OCP 8-bit floating point v1.0: E4M3 (bias 7, no infinities, S.1111.111
    the only NaN, largest 448), as torch's float8_e4m3fn;
  - NVIDIA's NVFP4: E2M1 elements in blocks of 16, each block an E4M3 scale, times one F32 scale
    per tensor;
  - DeepSeek-V3's FP8 weights: F8_E4M3 with an F32 `weight_scale_inv` per 128 x 128 block,
    dequantized as weight * scale_inv (its inference/kernel.py weight_dequant);
  - FP8 with a scale per output channel or per tensor (compressed-tensors' float-quantized
    `weight_scale` [M, 1] in the model's dtype, FBGEMM's F32 [M, 1], AutoFP8's F32 []),
    dequantized as weight * weight_scale.

Each value's dequantized form is computed exactly (a product of at most 30 significant bits is
exact in a Python float) and rounded once, to nearest with ties to even, into F32 and BF16 by the
bit arithmetic below.

    python3 tests/quant/make_quant_goldens.py [OUTDIR]      (default tests/fixtures/quant)

Deterministic: a fixed seed, so a re-run writes the same bytes. No torch, no numpy.

OUTDIR/<case>/ is a Hugging Face folder (config.json with its quantization_config, the weights in
model.safetensors) and OUTDIR/<case>/expected/{f32,bf16}.safetensors hold each quantized weight's
dequantized value under its logical name (the weight's name; gpt-oss's `X_blocks` as `X`), in F32
and BF16.
"""
import json
import math
import os
import random
import struct
import sys

# ---- element formats, from their definitions ---------------------------------------------------


def e4m3(code):
    """The value of an FP8 E4M3 (fn) code; None for its NaN codes."""
    s, e, m = code >> 7, (code >> 3) & 0xF, code & 0x7
    if e == 0xF and m == 0x7:
        return None
    v = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if s else v


def e8m0(code):
    """The value of an E8M0 scale: 2^(code - 127); None for 0xFF (NaN)."""
    return None if code == 0xFF else 2.0 ** (code - 127)


def e2m1(nibble):
    """The value of an FP4 E2M1 code (4 bits)."""
    s, e, m = nibble >> 3, (nibble >> 1) & 0x3, nibble & 0x1
    v = m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
    return -v if s else v


def round_to(x, mant_bits, min_exp, max_exp):
    """x (a float, exact) rounded once to a binary format with mant_bits stored mantissa bits,
    normal exponents min_exp..max_exp: nearest, ties to even; past the largest finite, infinity.
    Returns the rounded value as a float."""
    if x == 0 or math.isinf(x) or math.isnan(x):
        return x
    sign = -1.0 if x < 0 else 1.0
    a = abs(x)
    e = math.frexp(a)[1] - 1  # a = 1.f * 2^e
    e = max(e, min_exp)  # subnormals share the smallest exponent's quantum
    quantum = 2.0 ** (e - mant_bits)
    q = a / quantum  # exact: a power-of-two division
    n = math.floor(q)
    r = q - n
    if r > 0.5 or (r == 0.5 and n % 2 == 1):
        n += 1
    v = n * quantum
    largest = (2 - 2.0 ** -mant_bits) * 2.0 ** max_exp
    if v > largest:
        return sign * math.inf
    return sign * v


def f32_bits(x):
    return struct.pack("<f", round_to(x, 23, -126, 127))


def bf16_bits(x):
    v = round_to(x, 7, -126, 127)
    return struct.pack("<f", v)[2:4]  # exact in F32, so its top half is the BF16


# ---- safetensors, by hand ---------------------------------------------------------------------


def write_safetensors(path, tensors):
    """tensors: {name: (dtype, shape, bytes)} in the order given."""
    header, data = {}, b""
    for name, (dt, shape, b) in tensors.items():
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [len(data), len(data) + len(b)]}
        data += b
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


# ---- the cases --------------------------------------------------------------------------------


def random_e4m3(rng, n):
    """n E4M3 codes, never NaN, spread over the whole range (subnormals and 448 included)."""
    out = bytearray()
    for _ in range(n):
        c = rng.randrange(256)
        while e4m3(c) is None:
            c = rng.randrange(256)
        out.append(c)
    return bytes(out)


def fp8_block(rng, shape, block):
    """DeepSeek-V3's form: (weight bytes, scale_inv shape, scale_inv bytes, values)."""
    rows, cols = shape
    w = random_e4m3(rng, rows * cols)
    sr, sc = -(-rows // block[0]), -(-cols // block[1])
    scales = [rng.uniform(0.5, 1.0) * 2.0 ** rng.randrange(-12, -2) for _ in range(sr * sc)]
    scales = [struct.unpack("<f", struct.pack("<f", s))[0] for s in scales]  # as F32 holds them
    vals = [e4m3(w[r * cols + c]) * scales[(r // block[0]) * sc + c // block[1]]
            for r in range(rows) for c in range(cols)]
    return w, (sr, sc), b"".join(struct.pack("<f", s) for s in scales), vals


def pack_fp4(codes):
    """Two E2M1 codes a byte, the first in the low nibble (OCP MX, gpt-oss, torch's float4_e2m1fn_x2)."""
    return bytes(codes[i] | (codes[i + 1] << 4) for i in range(0, len(codes), 2))


def mxfp4(rng, lead, groups):
    """gpt-oss's form: X_blocks U8 [*lead, groups, 16] and X_scales U8 [*lead, groups] (E8M0 as
    bytes); the logical tensor is [*lead, groups * 32]."""
    n = numel(lead) * groups
    codes = [rng.randrange(16) for _ in range(n * 32)]
    scales = [rng.randrange(112, 136) for _ in range(n)]  # 2^-15 .. 2^8
    vals = [e2m1(codes[i]) * e8m0(scales[i // 32]) for i in range(n * 32)]
    return pack_fp4(codes), bytes(scales), vals


def mxfp8(rng, shape):
    """MXFP8: weight F8_E4M3 [rows, cols], weight_scale F8_E8M0 [rows, cols / 32]."""
    rows, cols = shape
    w = random_e4m3(rng, rows * cols)
    scales = [rng.randrange(100, 140) for _ in range(rows * cols // 32)]
    vals = [e4m3(w[i]) * e8m0(scales[i // 32]) for i in range(rows * cols)]
    return w, bytes(scales), vals


def nvfp4(rng, shape):
    """NVIDIA ModelOpt's NVFP4: weight U8 [rows, cols / 2] (packed E2M1), weight_scale F8_E4M3
    [rows, cols / 16], weight_scale_2 F32 [] (per tensor)."""
    rows, cols = shape
    codes = [rng.randrange(16) for _ in range(rows * cols)]
    # block scales: positive E4M3 codes (as a quantizer makes them: amax / 6 / global)
    scales = []
    for _ in range(rows * cols // 16):
        c = rng.randrange(0x08, 0x7F)  # positive normals, not NaN
        scales.append(c)
    g = struct.unpack("<f", struct.pack("<f", rng.uniform(0.5, 1.0) * 2.0 ** -9))[0]
    vals = [e2m1(codes[i]) * e4m3(scales[i // 16]) * g for i in range(rows * cols)]
    return pack_fp4(codes), bytes(scales), struct.pack("<f", g), vals


def fp8_scaled(rng, shape, scale_shape, scale_dtype):
    """FP8 per channel (scale_shape [rows, 1] or [rows]) or per tensor (one value): (weight bytes,
    scale bytes, values). The scales are exact in scale_dtype (BF16's 8 significant bits, or F32)."""
    rows, cols = shape
    w = random_e4m3(rng, rows * cols)
    n = numel(scale_shape)
    scales = [rng.uniform(0.5, 1.0) * 2.0 ** rng.randrange(-14, -4) for _ in range(n)]
    if scale_dtype == "BF16":
        scales = [struct.unpack("<f", b"\0\0" + bf16_bits(x))[0] for x in scales]
        sb = b"".join(bf16_bits(x) for x in scales)
    else:
        scales = [struct.unpack("<f", struct.pack("<f", x))[0] for x in scales]
        sb = b"".join(struct.pack("<f", x) for x in scales)
    vals = [e4m3(w[r * cols + c]) * scales[r if n > 1 else 0] for r in range(rows) for c in range(cols)]
    return w, sb, vals


def bf16_of(rng, n):
    return b"".join(bf16_bits(rng.uniform(-1, 1)) for _ in range(n))


def write_case(out, name, config, tensors, expected, extra_files=None):
    d = os.path.join(out, name)
    os.makedirs(os.path.join(d, "expected"), exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=1, sort_keys=True)
    for fn, obj in (extra_files or {}).items():
        with open(os.path.join(d, fn), "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
    write_safetensors(os.path.join(d, "model.safetensors"), tensors)
    write_safetensors(os.path.join(d, "expected", "f32.safetensors"),
                      {k: ("F32", s, b"".join(f32_bits(v) for v in vals)) for k, (s, vals) in expected.items()})
    write_safetensors(os.path.join(d, "expected", "bf16.safetensors"),
                      {k: ("BF16", s, b"".join(bf16_bits(v) for v in vals)) for k, (s, vals) in expected.items()})


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                             "fixtures", "quant")
    rng = random.Random(55)
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64}

    # DeepSeek-V3 FP8: 128 x 128 blocks, the last ones partial
    t, exp = {}, {}
    for name, shape in (("model.layers.0.self_attn.o_proj.weight", (136, 160)),
                        ("model.layers.0.mlp.down_proj.weight", (130, 144))):
        w, sshape, s, vals = fp8_block(rng, shape, (128, 128))
        t[name] = ("F8_E4M3", shape, w)
        t[name + "_scale_inv"] = ("F32", sshape, s)
        exp[name] = (shape, vals)
    # a block whose products land between BF16 neighbours just above the half-way point, a tail
    # F32 rounds away: 1.125 x s is exactly T * 2^-33 with T = 132 * 2^20 + 2^19 + 1, so rounded
    # once it goes up to 133 * 2^-13, while through F32 it becomes the tie 132.5 * 2^-13 and goes
    # to the even 132 * 2^-13 (torch's (w.float() * s).bfloat16() route)
    name, shape = "model.layers.0.mlp.gate_proj.weight", (4, 128)
    tie = (132 * 2 ** 20 + 2 ** 19 + 1) // 9
    assert tie * 9 == 132 * 2 ** 20 + 2 ** 19 + 1 and tie < 2 ** 24
    scale = tie * 2.0 ** -30
    w = bytearray(random_e4m3(rng, shape[0] * shape[1]))
    w[0::2] = bytes([0x39]) * (len(w) // 2)  # 1.125
    t[name] = ("F8_E4M3", shape, bytes(w))
    t[name + "_scale_inv"] = ("F32", (1, 1), struct.pack("<f", scale))
    exp[name] = (shape, [e4m3(c) * scale for c in w])
    t["model.norm.weight"] = ("BF16", (160,), bf16_of(rng, 160))
    write_case(out, "fp8_block", dict(base, quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}),
        t, exp)

    # gpt-oss MXFP4: experts' blocks and scales
    t, exp = {}, {}
    for name, lead, groups in (("model.layers.0.mlp.experts.gate_up_proj", (2, 64), 3),
                               ("model.layers.0.mlp.experts.down_proj", (2, 48), 2)):
        b, s, vals = mxfp4(rng, lead, groups)
        t[name + "_blocks"] = ("U8", lead + (groups, 16), b)
        t[name + "_scales"] = ("U8", lead + (groups,), s)
        exp[name] = (lead + (groups * 32,), vals)
    t["model.layers.0.mlp.router.weight"] = ("BF16", (2, 64), bf16_of(rng, 128))
    write_case(out, "mxfp4", dict(base, model_type="gpt_oss", quantization_config={
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.mlp.router"]}), t, exp)

    # MXFP8: F8_E4M3 elements, an F8_E8M0 scale per 32 along the last dimension
    t, exp = {}, {}
    name = "model.layers.0.mlp.up_proj.weight"
    w, s, vals = mxfp8(rng, (64, 96))
    t[name] = ("F8_E4M3", (64, 96), w)
    t[name[:-len("weight")] + "weight_scale"] = ("F8_E8M0", (64, 3), s)
    exp[name] = ((64, 96), vals)
    write_case(out, "mxfp8", dict(base, quantization_config={"quant_method": "mxfp8"}), t, exp)

    # NVFP4 (ModelOpt): packed E2M1, E4M3 scales per 16, one F32 scale per tensor
    t, exp = {}, {}
    for name, shape in (("model.layers.0.mlp.gate_proj.weight", (64, 96)),
                        ("model.layers.0.self_attn.q_proj.weight", (48, 64))):
        w, s, g, vals = nvfp4(rng, shape)
        stem = name[:-len("weight")]
        t[name] = ("U8", (shape[0], shape[1] // 2), w)
        t[stem + "weight_scale"] = ("F8_E4M3", (shape[0], shape[1] // 16), s)
        t[stem + "weight_scale_2"] = ("F32", (), g)
        t[stem + "input_scale"] = ("F32", (), struct.pack("<f", 1.0))
        exp[name] = (shape, vals)
    write_case(out, "nvfp4", dict(base, quantization_config={
        "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}), t, exp,
        {"hf_quant_config.json": {"producer": {"name": "modelopt"},
                                  "quantization": {"quant_algo": "NVFP4", "group_size": 16}}})

    # FP8 per output channel and per tensor: compressed-tensors (BF16 [M, 1], and its per-tensor
    # [1]), FBGEMM (F32 [M, 1]), AutoFP8 (F32 []), a per-channel F32 [M]; an activation
    # input_scale, which stays a plain tensor
    t, exp = {}, {}
    for name, shape, sshape, sdt in (("model.layers.0.self_attn.q_proj.weight", (48, 64), (48, 1), "BF16"),
                                     ("model.layers.0.self_attn.k_proj.weight", (16, 64), (1,), "BF16"),
                                     ("model.layers.0.mlp.up_proj.weight", (40, 96), (40, 1), "F32"),
                                     ("model.layers.0.mlp.down_proj.weight", (64, 40), (), "F32"),
                                     ("model.layers.0.mlp.gate_proj.weight", (40, 64), (40,), "F32")):
        w, sb, vals = fp8_scaled(rng, shape, sshape, sdt)
        stem = name[:-len("weight")]
        t[name] = ("F8_E4M3", shape, w)
        t[stem + "weight_scale"] = (sdt, sshape, sb)
        exp[name] = (shape, vals)
    t["model.layers.0.self_attn.q_proj.input_scale"] = ("BF16", (1,), bf16_bits(0.0234375))
    t["lm_head.weight"] = ("BF16", (8, 64), bf16_of(rng, 8 * 64))
    write_case(out, "fp8_channel", dict(base, quantization_config={
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}}}}),
        t, exp)
    print(f"wrote {out}: fp8_block, mxfp4, mxfp8, nvfp4, fp8_channel")


if __name__ == "__main__":
    main()
