// shardsafe/torch/tensor_view.hpp - LibTorch tensors as flat views, and dtype mapping.
//
// One of the torch/ headers: the headers under include/shardsafe/torch/ include LibTorch (ATen
// for tensors, the c10d process groups, parts of torch/nn and torch/optim for modules and
// optimizers), and no header outside torch/ does (scripts/check_layering.sh checks it). Each
// includes the narrowest LibTorch header it needs, never <torch/torch.h>: this one needs
// <ATen/ATen.h> only.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/core/dtype.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/core/shape.hpp"

namespace shardsafe {

/// The LibTorch ScalarType of a dtype, where LibTorch 1.13 has one.
inline std::optional<at::ScalarType> to_scalar_type(dtype t) noexcept {
  switch (t) {
    case dtype::BOOL: return at::kBool;
    case dtype::U8: return at::kByte;
    case dtype::I8: return at::kChar;
    case dtype::I16: return at::kShort;
    case dtype::I32: return at::kInt;
    case dtype::I64: return at::kLong;
    case dtype::F16: return at::kHalf;
    case dtype::BF16: return at::kBFloat16;
    case dtype::F32: return at::kFloat;
    case dtype::F64: return at::kDouble;
    case dtype::C64: return at::kComplexFloat;
    default: return std::nullopt;
  }
}

/// The dtype of a LibTorch ScalarType; throws errc::unsupported_dtype for types safetensors lacks.
inline dtype to_dtype(at::ScalarType s, std::string_view ctx = "tensor") {
  switch (s) {
    case at::kBool: return dtype::BOOL;
    case at::kByte: return dtype::U8;
    case at::kChar: return dtype::I8;
    case at::kShort: return dtype::I16;
    case at::kInt: return dtype::I32;
    case at::kLong: return dtype::I64;
    case at::kHalf: return dtype::F16;
    case at::kBFloat16: return dtype::BF16;
    case at::kFloat: return dtype::F32;
    case at::kDouble: return dtype::F64;
    case at::kComplexFloat: return dtype::C64;
    default:
      fail(errc::unsupported_dtype,
           std::string(ctx) + ": LibTorch dtype " + std::string(c10::toString(s)) + " has no safetensors dtype");
  }
}

/// Throws errc::unsupported_dtype unless LibTorch has a ScalarType for t.
inline at::ScalarType require_scalar_type(dtype t, std::string_view ctx) {
  if (auto s = to_scalar_type(t)) return *s;
  fail(errc::unsupported_dtype, std::string(ctx) + ": dtype " + std::string(to_string(t)) +
                                    " has no LibTorch 1.13 ScalarType; read it as raw bytes instead");
}

inline shape_t shape_of(const at::Tensor& t) {
  shape_t s;
  for (auto d : t.sizes()) s.push_back(static_cast<std::uint64_t>(d));
  return s;
}

inline std::vector<std::int64_t> to_sizes(std::span<const std::uint64_t> s) {
  return std::vector<std::int64_t>(s.begin(), s.end());
}

/// True when a flat view can point straight at t's memory.
inline bool is_viewable(const at::Tensor& t) noexcept {
  return t.defined() && t.device().is_cpu() && t.is_contiguous() && !t.is_sparse() && !t.is_quantized();
}

/// A flat view of t's memory: t holds the shard `spec` (nullopt: all) of a tensor of shape
/// `full` (empty optional: t's own shape). t must be CPU and contiguous.
inline flat_view make_flat_view(std::string key, const at::Tensor& t, std::optional<shard_spec> spec = std::nullopt,
                                std::optional<shape_t> full = std::nullopt) {
  if (!t.defined()) fail(errc::invalid_argument, "tensor '" + key + "': undefined tensor");
  if (!is_viewable(t))
    fail(errc::invalid_argument, "tensor '" + key + "': needs a contiguous CPU tensor (got " +
                                     std::string(t.device().str()) + (t.is_contiguous() ? "" : ", non-contiguous") +
                                     ")");
  flat_view v;
  v.type = to_dtype(t.scalar_type(), "tensor '" + key + "'");
  v.full_shape = full ? *full : shape_of(t);
  v.spec = std::move(spec);
  v.data = static_cast<std::byte*>(t.data_ptr());
  v.nbytes = t.nbytes();
  v.key = std::move(key);
  return v;
}

}  // namespace shardsafe
