// examples/sharded_mlp.hpp - a small MLP trained with flat-sharded parameters and optimizer
// state, FSDP-style, on any world size. Used by the end-to-end demo and the resume tests.
//
// Every rank owns a flat shard of every parameter (a contiguous range of its flattened
// elements) and runs the optimizer on its shards only. Before each step the shards are
// all-gathered into full parameters; every rank computes the same full-batch gradient; each
// takes its own slice of it. Shard boundaries fall on multiples of 64 elements, so whatever
// the world size each element goes through the same (vectorized or scalar) kernel path: the
// training trajectory does not depend on the world size, and any difference after a resume
// is a checkpoint bug, not a change of float summation order.
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "shardsafe/dist/concepts.hpp"
#include "shardsafe/format/safetensors_writer.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/torch/state_dict.hpp"

namespace demo {

using shardsafe::shape_t;

struct param_def {
  std::string name;
  shape_t shape;
  int group;  ///< 0: weights, 1: biases and norms (another learning rate)
};

inline std::vector<param_def> mlp_params(int in = 24, int hidden = 48) {
  return {{"layers.0.weight", {static_cast<std::uint64_t>(hidden), static_cast<std::uint64_t>(in)}, 0},
          {"layers.0.bias", {static_cast<std::uint64_t>(hidden)}, 1},
          {"norm.weight", {static_cast<std::uint64_t>(hidden)}, 1},
          {"norm.bias", {static_cast<std::uint64_t>(hidden)}, 1},
          {"layers.1.weight", {static_cast<std::uint64_t>(in), static_cast<std::uint64_t>(hidden)}, 0},
          {"layers.1.bias", {static_cast<std::uint64_t>(in)}, 1}};
}

/// Rank r's flat range of n elements in a world of w: 64-element-aligned even parts.
inline std::pair<std::uint64_t, std::uint64_t> shard_range(std::uint64_t n, int w, int r) {
  const std::uint64_t per = ((n + w - 1) / w + 63) / 64 * 64;
  const std::uint64_t b = std::min<std::uint64_t>(n, per * static_cast<std::uint64_t>(r));
  return {b, std::min<std::uint64_t>(n, b + per)};
}

/// Deterministic values from a name and an index (no RNG state involved).
inline at::Tensor hashed(const std::string& tag, at::IntArrayRef shape, double scale) {
  at::Tensor t = at::empty(shape, at::kFloat);
  float* p = t.data_ptr<float>();
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : tag) h = (h ^ c) * 1099511628211ull;
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    std::uint64_t x = h + static_cast<std::uint64_t>(i) * 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    p[i] = static_cast<float>((static_cast<double>(x >> 11) / 9007199254740992.0 * 2.0 - 1.0) * scale);
  }
  return t;
}

enum class optim_kind { adam, adamw, sgd, adagrad, rmsprop };

inline optim_kind optim_from_name(const std::string& s) {
  if (s == "adam") return optim_kind::adam;
  if (s == "adamw") return optim_kind::adamw;
  if (s == "sgd") return optim_kind::sgd;
  if (s == "adagrad") return optim_kind::adagrad;
  if (s == "rmsprop") return optim_kind::rmsprop;
  throw std::invalid_argument("unknown optimizer '" + s + "'");
}

/// The full initial value of parameter d (what a "pretrained" checkpoint of the demo holds).
inline at::Tensor initial_value(const param_def& d) {
  at::Tensor full = hashed("init:" + d.name, shardsafe::to_sizes(d.shape), d.group == 0 ? 0.3 : 0.1);
  if (d.name == "norm.weight") full = full + 1.0;
  return full;
}

/// The model: this rank's shards, the optimizer over them, the data.
class sharded_mlp {
 public:
  /// `group_order_reversed` builds the param groups (and the parameter list) in the other
  /// order, as a differently written training script would.
  sharded_mlp(int world, int rank, optim_kind kind, bool group_order_reversed = false, bool zero_init = false,
              int in = 24, int hidden = 48)
      : world_(world), rank_(rank), in_(in), hidden_(hidden), defs_(mlp_params(in, hidden)) {
    if (group_order_reversed) std::reverse(defs_.begin(), defs_.end());
    for (const auto& d : defs_) {
      const std::uint64_t n = shardsafe::numel(d.shape);
      auto [b, e] = shard_range(n, world, rank);
      at::Tensor full = initial_value(d);
      at::Tensor local =
          zero_init ? at::zeros({static_cast<std::int64_t>(e - b)})
                    : full.reshape({-1}).slice(0, static_cast<std::int64_t>(b), static_cast<std::int64_t>(e)).clone();
      local.set_requires_grad(true);
      locals_.push_back(local);
      ranges_.emplace_back(b, e);
    }
    // two groups with different learning rates; group order follows defs_
    std::vector<torch::optim::OptimizerParamGroup> groups;
    std::vector<int> order = group_order_reversed ? std::vector<int>{1, 0} : std::vector<int>{0, 1};
    for (int g : order) {
      std::vector<at::Tensor> ps;
      for (std::size_t i = 0; i < defs_.size(); ++i)
        if (defs_[i].group == g) ps.push_back(locals_[i]);
      const double lr = zero_init ? 0.5 : (g == 0 ? 0.05 : 0.02);  // a resumed run must get lr back from the checkpoint
      groups.emplace_back(ps, make_options(kind, lr));
    }
    optim_ = make_optimizer(kind, std::move(groups));
    x_ = hashed("data:x", {64, in}, 1.0);
    y_ = at::tanh(hashed("data:y", {64, in}, 1.5));
  }

  /// Bytes of the full parameters.
  std::uint64_t param_bytes() const {
    std::uint64_t n = 0;
    for (const auto& d : defs_) n += shardsafe::numel(d.shape) * 4;
    return n;
  }

  /// This rank's shards as a state dict (the optimizer's own tensors).
  shardsafe::state_dict state() const {
    shardsafe::state_dict sd;
    for (std::size_t i = 0; i < defs_.size(); ++i)
      sd.add(defs_[i].name, locals_[i], shardsafe::flat_spec{{ranges_[i].first, ranges_[i].second}}, defs_[i].shape);
    return sd;
  }
  torch::optim::Optimizer& optimizer() { return *optim_; }

  /// Full parameters, gathered from every rank's shards.
  template <shardsafe::Comm C>
  std::vector<at::Tensor> gather(C& comm) const {
    std::vector<at::Tensor> full;
    for (std::size_t i = 0; i < defs_.size(); ++i) {
      const at::Tensor& l = locals_[i];
      auto parts = comm.all_gather_bytes(std::string_view(static_cast<const char*>(l.data_ptr()), l.nbytes()));
      std::string all;
      for (const auto& p : parts) all += p;
      at::Tensor f = at::empty(shardsafe::to_sizes(defs_[i].shape), at::kFloat);
      if (all.size() != f.nbytes()) throw std::runtime_error("gather: shards do not add up to " + defs_[i].name);
      std::memcpy(f.data_ptr(), all.data(), all.size());
      full.push_back(f);
    }
    return full;
  }

  /// One training step; returns the loss (the same on every rank).
  template <shardsafe::Comm C>
  double step(C& comm) {
    std::vector<at::Tensor> full = gather(comm);
    for (auto& f : full) f.set_requires_grad(true);
    auto param = [&](const std::string& n) -> at::Tensor& {
      for (std::size_t i = 0; i < defs_.size(); ++i)
        if (defs_[i].name == n) return full[i];
      throw std::runtime_error("no parameter " + n);
    };
    at::Tensor h = at::linear(x_, param("layers.0.weight"), param("layers.0.bias"));
    h = at::layer_norm(h, {hidden_}, param("norm.weight"), param("norm.bias"));
    h = at::tanh(h);
    at::Tensor out = at::linear(h, param("layers.1.weight"), param("layers.1.bias"));
    at::Tensor loss = at::mse_loss(out, y_);
    loss.backward();
    for (std::size_t i = 0; i < defs_.size(); ++i) {
      at::Tensor g = full[i].grad().reshape({-1}).slice(0, static_cast<std::int64_t>(ranges_[i].first),
                                                        static_cast<std::int64_t>(ranges_[i].second));
      locals_[i].mutable_grad() = g.clone();
    }
    optim_->step();
    optim_->zero_grad();
    return loss.item<double>();
  }

  /// The full parameters by name, in the canonical order (for comparing runs).
  template <shardsafe::Comm C>
  std::vector<std::pair<std::string, at::Tensor>> full_params(C& comm) const {
    auto full = gather(comm);
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (const auto& d : mlp_params(in_, hidden_))
      for (std::size_t i = 0; i < defs_.size(); ++i)
        if (defs_[i].name == d.name) out.emplace_back(d.name, full[i]);
    return out;
  }

 private:
  static std::unique_ptr<torch::optim::OptimizerOptions> make_options(optim_kind k, double lr) {
    switch (k) {
      case optim_kind::adam:
        return std::make_unique<torch::optim::AdamOptions>(torch::optim::AdamOptions(lr).betas({0.9, 0.95}));
      case optim_kind::adamw:
        return std::make_unique<torch::optim::AdamWOptions>(
            torch::optim::AdamWOptions(lr).weight_decay(0.1).amsgrad(true));
      case optim_kind::sgd:
        return std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(lr).momentum(0.9).dampening(0.1));
      case optim_kind::adagrad:
        return std::make_unique<torch::optim::AdagradOptions>(
            torch::optim::AdagradOptions(lr).initial_accumulator_value(0.1));
      case optim_kind::rmsprop:
        return std::make_unique<torch::optim::RMSpropOptions>(
            torch::optim::RMSpropOptions(lr).momentum(0.5).centered(true));
    }
    return nullptr;
  }
  static std::unique_ptr<torch::optim::Optimizer> make_optimizer(optim_kind k,
                                                                 std::vector<torch::optim::OptimizerParamGroup> g) {
    switch (k) {
      case optim_kind::adam: return std::make_unique<torch::optim::Adam>(std::move(g));
      case optim_kind::adamw: return std::make_unique<torch::optim::AdamW>(std::move(g));
      case optim_kind::sgd: return std::make_unique<torch::optim::SGD>(std::move(g), torch::optim::SGDOptions(0.01));
      case optim_kind::adagrad: return std::make_unique<torch::optim::Adagrad>(std::move(g));
      case optim_kind::rmsprop: return std::make_unique<torch::optim::RMSprop>(std::move(g));
    }
    return nullptr;
  }

  int world_, rank_;
  std::int64_t in_, hidden_;
  std::vector<param_def> defs_;
  std::vector<at::Tensor> locals_;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges_;
  std::unique_ptr<torch::optim::Optimizer> optim_;
  at::Tensor x_, y_;
};

/// Writes named F32 tensors (full parameters) to a safetensors file, to compare runs.
inline void write_params(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& params) {
  std::vector<shardsafe::tensor_data> ts;
  for (const auto& [n, t] : params)
    ts.push_back({n,
                  shardsafe::dtype::F32,
                  shardsafe::shape_of(t),
                  {static_cast<const std::byte*>(t.data_ptr()), static_cast<std::size_t>(t.nbytes())}});
  shardsafe::file_writer w(path);
  shardsafe::write_safetensors(w, std::span<const shardsafe::tensor_data>(ts));
}

}  // namespace demo
