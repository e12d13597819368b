// tests/torch/fixtures.hpp - expected tensors computed independently of shardsafe.
//
// Element i of tensor `key` has the bits splitmix64(fnv1a(key) + i), cut to the dtype's size
// (BOOL: the low bit). Shards of the expected tensor are cut with ATen's own slice/narrow, not
// with shardsafe's cursors, so a test compares the library against a separate computation.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "shardsafe/shard/shard_spec.hpp"
#include "shardsafe/torch/tensor_view.hpp"

namespace testing {

inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

inline std::uint64_t fnv1a(const std::string& s) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

/// The full expected tensor. `finite` keeps floating values finite (for NaN checks).
inline at::Tensor expected_full(const std::string& key, shardsafe::dtype t, const shardsafe::shape_t& shape,
                                bool finite = false) {
  at::Tensor out = at::empty(shardsafe::to_sizes(shape), *shardsafe::to_scalar_type(t));
  const std::size_t item = shardsafe::item_size(t);
  auto* p = static_cast<unsigned char*>(out.data_ptr());
  const std::uint64_t seed = fnv1a(key);
  for (std::int64_t i = 0; i < out.numel(); ++i) {
    std::uint64_t bits = splitmix64(seed + static_cast<std::uint64_t>(i));
    if (t == shardsafe::dtype::BOOL) bits &= 1;
    if (finite) {
      if (t == shardsafe::dtype::F32) bits = (bits & 0x807FFFFFull) | 0x3F000000ull;  // [0.5, 2)
      if (t == shardsafe::dtype::BF16) bits = (bits & 0x807Full) | 0x3F00ull;
      if (t == shardsafe::dtype::F16) bits = (bits & 0x83FFull) | 0x3800ull;
      if (t == shardsafe::dtype::F64) bits = (bits & 0x800FFFFFFFFFFFFFull) | 0x3FE0000000000000ull;
    }
    std::memcpy(p + static_cast<std::size_t>(i) * item, &bits, item);
  }
  return out;
}

/// The local data of shard `spec` of `full`, cut with ATen: flat ranges are slices of the
/// flattened tensor, concatenated; a block is narrowed along every dimension.
inline at::Tensor local_of(const at::Tensor& full, const std::optional<shardsafe::shard_spec>& spec) {
  if (!spec) return full.clone();
  if (spec->is_flat()) {
    at::Tensor flat = full.reshape({-1});
    std::vector<at::Tensor> parts;
    for (const auto& r : spec->flat().ranges())
      parts.push_back(flat.slice(0, static_cast<std::int64_t>(r.begin), static_cast<std::int64_t>(r.end)));
    if (parts.empty()) return at::empty({0}, full.options());
    return at::cat(parts).contiguous();
  }
  at::Tensor t = full;
  const auto& b = spec->block();
  for (std::size_t d = 0; d < b.local_shape().size(); ++d)
    t = t.narrow(static_cast<std::int64_t>(d), static_cast<std::int64_t>(b.global_offset()[d]),
                 static_cast<std::int64_t>(b.local_shape()[d]));
  return t.contiguous();
}

/// Bytes equal?
inline bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.numel() != b.numel()) return false;
  at::Tensor ac = a.contiguous(), bc = b.contiguous();
  return std::memcmp(ac.data_ptr(), bc.data_ptr(), ac.nbytes()) == 0;
}

/// Even split of n into w parts: [begin, end) of part r (ceil-sized parts first, as FSDP).
inline std::pair<std::uint64_t, std::uint64_t> even_part(std::uint64_t n, int w, int r) {
  const std::uint64_t per = (n + static_cast<std::uint64_t>(w) - 1) / static_cast<std::uint64_t>(w);
  const std::uint64_t b = std::min<std::uint64_t>(n, per * static_cast<std::uint64_t>(r));
  return {b, std::min<std::uint64_t>(n, b + per)};
}

/// A flat (FSDP-like) spec: part r of an even split.
inline shardsafe::shard_spec flat_part(const shardsafe::shape_t& shape, int w, int r) {
  std::uint64_t n = 1;
  for (auto d : shape) n *= d;
  auto [b, e] = even_part(n, w, r);
  return shardsafe::flat_spec{{b, e}};
}

/// A block spec: part r of an even split of dimension `dim`.
inline shardsafe::shard_spec block_part(const shardsafe::shape_t& shape, std::size_t dim, int w, int r) {
  auto [b, e] = even_part(shape[dim], w, r);
  shardsafe::shape_t local = shape, off(shape.size(), 0);
  local[dim] = e - b;
  off[dim] = b;
  return shardsafe::block_spec(local, off);
}

}  // namespace testing

#include "support/test_util.hpp"

namespace testing {

/// SHA-256 (hex) of a tensor's bytes, straight from OpenSSL.
inline std::string sha256_hex(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return sha256_hex(c.data_ptr(), c.nbytes());
}

/// What f throws as a shardsafe::error ("" when it throws nothing), and its code in *code.
inline std::string error_of(const std::function<void()>& f, shardsafe::errc* code = nullptr) {
  try {
    f();
  } catch (const shardsafe::error& e) {
    if (code) *code = static_cast<shardsafe::errc>(e.code().value());
    return e.what();
  }
  return "";
}

}  // namespace testing
