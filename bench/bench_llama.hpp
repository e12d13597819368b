// bench/bench_llama.hpp - a Llama-shaped model's tensors and torch.chunk's even split, what the
// scale benchmarks (bench_scale, bench_save_scale) build their worlds from. No LibTorch.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "shardsafe/core/shape.hpp"

namespace bench {

struct model_tensor {
  std::string name;
  shardsafe::shape_t shape;
  int kind;   // 0 rows over TP, 1 columns over TP, 2 whole (norms)
  int layer;  // -1: embeddings (first stage), -2: final norm and lm_head (last stage)
};

/// Embeddings, `layers` blocks of 9 tensors (attention q, k, v, o; MLP gate, up, down; two
/// norms), the final norm and lm_head. Llama-3-70B: llama(80, 8192, 28672, 8 * 128, 128256).
inline std::vector<model_tensor> llama(int layers, std::uint64_t hidden, std::uint64_t inter, std::uint64_t kv,
                                       std::uint64_t vocab) {
  std::vector<model_tensor> m{{"model.embed_tokens.weight", {vocab, hidden}, 0, -1}};
  for (int l = 0; l < layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    m.push_back({p + "self_attn.q_proj.weight", {hidden, hidden}, 0, l});
    m.push_back({p + "self_attn.k_proj.weight", {kv, hidden}, 0, l});
    m.push_back({p + "self_attn.v_proj.weight", {kv, hidden}, 0, l});
    m.push_back({p + "self_attn.o_proj.weight", {hidden, hidden}, 1, l});
    m.push_back({p + "mlp.gate_proj.weight", {inter, hidden}, 0, l});
    m.push_back({p + "mlp.up_proj.weight", {inter, hidden}, 0, l});
    m.push_back({p + "mlp.down_proj.weight", {hidden, inter}, 1, l});
    m.push_back({p + "input_layernorm.weight", {hidden}, 2, l});
    m.push_back({p + "post_attention_layernorm.weight", {hidden}, 2, l});
  }
  m.push_back({"model.norm.weight", {hidden}, 2, -2});
  m.push_back({"lm_head.weight", {vocab, hidden}, 0, -2});
  return m;
}

/// [b, e) of part r of n over len elements: torch.chunk's pieces of ceil(len / n), the last ones
/// short or empty.
inline std::pair<std::uint64_t, std::uint64_t> even_part(std::uint64_t len, std::uint64_t n, std::uint64_t r) {
  const std::uint64_t c = (len + n - 1) / n;
  return {std::min(len, c * r), std::min(len, c * (r + 1))};
}

}  // namespace bench
