"""bench/device_peers.py - the Python side of bench_device (scripts/device-check.sh runs it).

  device_peers.py write DIR GIB [PT]  a Llama-shaped BF16 state dict of about GIB GiB, random
                                  values, as DIR/st/model.safetensors (safetensors) and, unless
                                  PT is 0, DIR/pt/model.pt (torch.save); under 1 GiB, of smaller
                                  shapes (a rehearsal's: bench_device --cpu-rehearsal); where the
                                  safetensors package is missing, the file is written by hand
  device_peers.py st DIR          safetensors.torch.load_file(device="cuda") of DIR/st
  device_peers.py pt DIR          torch.load(map_location="cuda") of DIR/pt
  device_peers.py pt_mmap DIR     the same with mmap=True

Each load runs in a fresh process (this one) after the CUDA context is made, and prints
`PEER name GB/s seconds maxrss_mib`.
"""
import json
import os
import resource
import struct
import sys
import time

import torch


def llama_shapes(gib):
    hidden, inter, vocab = (4096, 11008, 32000) if gib >= 1 else (1024, 2816, 8000)
    shapes = [("model.embed_tokens.weight", (vocab, hidden)), ("lm_head.weight", (vocab, hidden))]
    total = 2 * vocab * hidden * 2
    layer = [("self_attn.q_proj.weight", (hidden, hidden)), ("self_attn.k_proj.weight", (hidden, hidden)),
             ("self_attn.v_proj.weight", (hidden, hidden)), ("self_attn.o_proj.weight", (hidden, hidden)),
             ("mlp.gate_proj.weight", (inter, hidden)), ("mlp.up_proj.weight", (inter, hidden)),
             ("mlp.down_proj.weight", (hidden, inter)), ("input_layernorm.weight", (hidden,)),
             ("post_attention_layernorm.weight", (hidden,))]
    per_layer = sum(2 * torch.Size(s).numel() for _, s in layer)
    i = 0
    while total + per_layer <= gib * 2**30:
        shapes += [(f"model.layers.{i}.{n}", s) for n, s in layer]
        total += per_layer
        i += 1
    return shapes, total


def save_safetensors(sd, path):
    """safetensors' save_file, or the format by hand where the package is missing (a rehearsal's
    python: /usr/bin/python3 with torch and no safetensors)."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        save_file = None
    if save_file:
        save_file(sd, path)
        return
    names = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
    header, off = {}, 0
    for n, t in sd.items():
        nbytes = t.numel() * t.element_size()
        header[n] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for t in sd.values():
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes())


def write(root, gib, with_pt=True):
    shapes, total = llama_shapes(gib)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a rehearsal on a machine without a GPU
    gen = torch.Generator(device=dev).manual_seed(0)
    sd = {n: torch.randn(s, device=dev, generator=gen).to(torch.bfloat16).cpu() for n, s in shapes}
    os.makedirs(os.path.join(root, "st"), exist_ok=True)
    os.makedirs(os.path.join(root, "pt"), exist_ok=True)
    t0 = time.perf_counter()
    save_safetensors(sd, os.path.join(root, "st", "model.safetensors"))
    t1 = time.perf_counter()
    if with_pt:
        torch.save(sd, os.path.join(root, "pt", "model.pt"))
    t2 = time.perf_counter()
    print(f"wrote {len(shapes)} tensors, {total / 2**30:.2f} GiB: safetensors {t1 - t0:.1f} s, torch.save {t2 - t1:.1f} s")


def load(mode, root):
    torch.zeros(1, device="cuda")  # the CUDA context, outside the timing
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if mode == "st":
        from safetensors.torch import load_file
        sd = load_file(os.path.join(root, "st", "model.safetensors"), device="cuda")
    else:
        sd = torch.load(os.path.join(root, "pt", "model.pt"), map_location="cuda", weights_only=True,
                        mmap=(mode == "pt_mmap"))
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    assert all(t.is_cuda for t in sd.values())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"PEER {mode} {nbytes / dt / 1e9:.3f} {dt:.3f} {rss:.0f}")


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(sys.argv[2], float(sys.argv[3]), len(sys.argv) < 5 or sys.argv[4] != "0")
    else:
        load(sys.argv[1], sys.argv[2])
