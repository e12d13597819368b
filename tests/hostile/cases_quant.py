"""Hostile cases of quantized weights (issue 55, checkpoint/quant.hpp): the goldens of
tests/fixtures/quant/ copied and broken one way each, so that a weight would load off by its
scale; `verify` (which checks every weight with its scales) must refuse each naming the tensor and
the rule, and so must every command that reads tensor data (digest, unshard, to-hf with and without
--dequantize, to-dcp): one that copies weight and scale as stored would otherwise pass the broken
weight on. Loaded by hostile.py, with its helpers (run, case, write, safetensors_bytes, ...) in scope."""
import os
import shutil
import struct
import sys

QUANT = os.path.join(SOURCE, "tests", "fixtures", "quant")


def q_read(path):
    """[(name, dtype, shape, bytes)] of a safetensors file (golden_check's parser)."""
    sys.path.insert(0, os.path.join(SOURCE, "tests", "peers"))
    from golden_check import read_safetensors
    return [(k, dt, list(sh), b) for k, (dt, sh, b) in read_safetensors(path).items()]


def q_copy(t, golden, name, edit):
    """golden's folder copied to t/name with model.safetensors' tensor list edited by edit(list)."""
    d = os.path.join(t, name)
    shutil.copytree(os.path.join(QUANT, golden), d, ignore=shutil.ignore_patterns("expected"))
    tensors = q_read(os.path.join(d, "model.safetensors"))
    write(os.path.join(d, "model.safetensors"), safetensors_bytes(edit(tensors)))
    return d


def q_refused(case_name, d, words):
    """Every command that reads d's tensor data refuses it with words (verify's message), writing
    nothing (hostile.py's refused_by_all): to-hf as stored and with --dequantize."""
    outs = d + ".out"
    os.makedirs(outs)
    refused_by_all(case_name, d, outs, words, ("verify", "digest", "unshard", "to-hf", "to-dcp"))
    run(case_name, ["to-hf", d, os.path.join(outs, "hfd"), "--dequantize"], 1, words)
    if os.path.exists(os.path.join(outs, "hfd")) and os.listdir(os.path.join(outs, "hfd")):
        raise Failed(f"to-hf --dequantize refused {d} but wrote {os.path.join(outs, 'hfd')}")


def q_drop(name):
    return lambda ts: [x for x in ts if x[0] != name]


def q_set(name, dtype=None, shape=None, data=None):
    def edit(ts):
        out = []
        for n, dt, sh, b in ts:
            if n == name:
                dt, sh, b = dtype or dt, shape if shape is not None else sh, data(b) if data else b
            out.append((n, dt, sh, b))
        return out
    return edit


@case
def quant_scale_missing(t):
    """An FP8 weight whose weight_scale_inv is gone, in a folder whose config.json says it is
    quantized: verify refuses it (its values would be off by the scale); an NVFP4 weight without
    its per-tensor weight_scale_2 too. The untouched goldens verify."""
    for g in ("fp8_block", "mxfp4", "mxfp8", "nvfp4", "fp8_channel"):
        src, outs = os.path.join(QUANT, g), os.path.join(t, g + ".ok")
        os.makedirs(outs)
        for cmd in ("verify", "digest", "unshard", "to-hf", "to-dcp"):
            run("quant_scale_missing", command_argv(cmd, src, outs), 0)
        run("quant_scale_missing", ["to-hf", src, os.path.join(outs, "hfd"), "--dequantize"], 0)
    w = "model.layers.0.self_attn.o_proj.weight"
    d = q_copy(t, "fp8_block", "fp8", q_drop(w + "_scale_inv"))
    q_refused("quant_scale_missing", d, [w, "its scale is missing", "quantization_config"])
    g = "model.layers.0.mlp.gate_proj.weight_scale_2"
    d = q_copy(t, "nvfp4", "nv", q_drop(g))
    q_refused("quant_scale_missing", d, ["gate_proj.weight", g, "missing"])


@case
def quant_scale_lies(t):
    """Scales of the wrong shape for their block (an FP8 scale [1, 4] for a [136, 160] weight in
    128 x 128 blocks), of the wrong dtype (MXFP4 scales as F32), and MXFP4 blocks whose last
    dimension is not 16 bytes: each refused naming tensor and rule."""
    w = "model.layers.0.self_attn.o_proj.weight"
    d = q_copy(t, "fp8_block", "shape", q_set(w + "_scale_inv", shape=[1, 4]))
    q_refused("quant_scale_lies", d, [w + "_scale_inv", "[1,4]", "not [2,2]", "128 x 128"])
    s = "model.layers.0.mlp.experts.down_proj_scales"
    d = q_copy(t, "mxfp4", "dtype", q_set(s, dtype="I8"))
    q_refused("quant_scale_lies", d, [s, "is I8", "not U8 or F8_E8M0"])
    b = "model.layers.0.mlp.experts.down_proj_blocks"
    d = q_copy(t, "mxfp4", "blocks", q_set(b, shape=[2, 48, 4, 8]))
    q_refused("quant_scale_lies", d, [b, "not U8 [..., G, 16]"])


@case
def quant_nan_scales(t):
    """A scale that is NaN: E8M0's 0xFF (MXFP8), an F8_E4M3 NaN block scale (NVFP4), an F32 NaN
    (FP8 blocks): verify refuses each, naming the scale tensor and the index."""
    s = "model.layers.0.mlp.up_proj.weight_scale"
    d = q_copy(t, "mxfp8", "e8m0", q_set(s, data=lambda b: b[:7] + b"\xff" + b[8:]))
    q_refused("quant_nan_scales", d, [s, "flat index 7", "NaN or infinite"])
    s = "model.layers.0.mlp.gate_proj.weight_scale"
    d = q_copy(t, "nvfp4", "e4m3", q_set(s, data=lambda b: b"\x7f" + b[1:]))
    q_refused("quant_nan_scales", d, [s, "flat index 0", "NaN or infinite"])
    s = "model.layers.0.mlp.down_proj.weight_scale_inv"
    d = q_copy(t, "fp8_block", "f32", q_set(s, data=lambda b: b[:4] + struct.pack("<f", float("nan")) + b[8:]))
    q_refused("quant_nan_scales", d, [s, "flat index 1", "NaN or infinite"])


@case
def quant_fp8_channel_lies(t):
    """FP8 per channel (compressed-tensors, FBGEMM): a per-row scale of fewer rows than the weight,
    and a BF16 scale that is NaN, each refused by every command naming the scale; a weight whose
    per-row scale is there but whose weight is 3-D, refused naming the rule."""
    w = "model.layers.0.self_attn.q_proj.weight"
    s = "model.layers.0.self_attn.q_proj.weight_scale"
    d = q_copy(t, "fp8_channel", "rows", q_set(s, shape=[24, 1], data=lambda b: b[:48]))
    q_refused("quant_fp8_channel_lies", d, [w, "[24,1]", "not [48,1] or [48]", "per channel"])
    d = q_copy(t, "fp8_channel", "nan", q_set(s, data=lambda b: b[:10] + b"\xc0\x7f" + b[12:]))
    q_refused("quant_fp8_channel_lies", d, [s, "flat index 5", "NaN or infinite"])
    d = q_copy(t, "fp8_channel", "3d", q_set(w, shape=[4, 12, 64]))
    q_refused("quant_fp8_channel_lies", d, [w, "[4,12,64]", "2-D weights"])
