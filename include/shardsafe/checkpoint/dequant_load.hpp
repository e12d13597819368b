// shardsafe/checkpoint/dequant_load.hpp - the load of quantized weights (checkpoint/quant.hpp)
// into floating views, dequantized (docs/FORMAT.md §8): what shardsafe::load runs when a view asks
// a quantized weight for F32, BF16, F16 or F64. Each such view's shard needs a region of the
// stored elements (whole rows for flat ranges; for a block, the block, its last dimension widened
// to whole bytes, or to MXFP4's whole blocks of 32) and the scales covering it: read in the same
// plan as the other views, into buffers of that size, then each value written rounded once
// (core/quant.hpp).
#pragma once

#include <algorithm>
#include <bit>
#include <cstring>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/checkpoint/checkpoint_reader.hpp"
#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/checkpoint/load_options.hpp"
#include "shardsafe/checkpoint/quant.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/core/quant.hpp"
#include "shardsafe/detail/nan.hpp"
#include "shardsafe/detail/thread_pool.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

namespace detail {

/// The stored elements a view of a quantized weight needs, as a region of its logical tensor:
/// whole rows [r0, r1) of the tensor seen as [rows, n] (a flat view), or a block [lo, hi) widened
/// on the last dimension to whole bytes (and MXFP4's whole blocks); and the matching shards of
/// data and scale to read into buffers.
struct dequant_region {
  bool flat = false;
  std::uint64_t r0 = 0, r1 = 0;  // flat: rows of [rows, n]
  shape_t lo, hi;                // block: per dimension
  shard_spec data, scale;
  std::uint64_t data_bytes = 0, scale_count = 0;
};

inline dequant_region region_of(const quantized_tensor& q, const flat_view& v) {
  dequant_region g;
  const std::size_t k = q.shape.size();
  const std::uint64_t n = q.shape.back(), rows = numel(q.shape) / n;
  const unsigned bits = element_bits(q.scheme);
  const shard_spec spec = v.spec ? *v.spec : shard_spec(block_spec::whole(q.shape));
  if (spec.is_flat()) {
    g.flat = true;
    g.r0 = rows;
    for (const auto& rg : spec.flat().ranges())
      if (!rg.empty()) {
        g.r0 = std::min(g.r0, rg.begin / n);
        g.r1 = std::max(g.r1, ceil_div(rg.end, n));
      }
    if (g.r1 <= g.r0) g.r0 = g.r1 = 0;
    const std::uint64_t dn = numel(q.data_shape) / rows;  // stored elements a row
    g.data = flat_spec{{g.r0 * dn, g.r1 * dn}};
    g.data_bytes = (g.r1 - g.r0) * n * bits / 8;
    if (row_blocked(q.scheme)) {
      const std::uint64_t sr0 = g.r0 / q.block_rows, sr1 = ceil_div(g.r1, q.block_rows), len = scale_row_len(q);
      g.scale = flat_spec{{sr0 * len, sr1 * len}};
      g.scale_count = (sr1 - sr0) * len;
    } else {
      const std::uint64_t cn = n / q.block_cols;
      g.scale = flat_spec{{g.r0 * cn, g.r1 * cn}};
      g.scale_count = (g.r1 - g.r0) * cn;
    }
    return g;
  }
  const block_spec& b = spec.block();
  g.lo = b.global_offset();
  g.hi = g.lo;
  for (std::size_t d = 0; d < k; ++d) g.hi[d] += b.local_shape()[d];
  const std::uint64_t unit = q.scheme == quant_scheme::mxfp4 ? 32 : (bits == 4 ? 2 : 1);
  g.lo.back() = g.lo.back() / unit * unit;
  g.hi.back() = std::min(n, ceil_div(g.hi.back(), unit) * unit);
  shape_t size(k);
  for (std::size_t d = 0; d < k; ++d) size[d] = g.hi[d] - g.lo[d];
  // the stored elements and the scale block covering the region
  const quantized_shard stored = stored_blocks(q, g.lo, size);
  g.data = stored.data;
  g.scale = stored.scale;
  g.scale_count = g.scale.local_numel();
  g.data_bytes = numel(size) * bits / 8;
  return g;
}

/// Every code's value of a scheme's elements: E4M3's 256, E2M1's 16.
struct element_table {
  double v[256];
  static const element_table& of(quant_scheme s) {
    static const element_table e4m3 = [] {
      element_table t{};
      for (unsigned c = 0; c < 256; ++c) t.v[c] = e4m3_value(static_cast<std::uint8_t>(c));
      return t;
    }();
    static const element_table e2m1 = [] {
      element_table t{};
      for (unsigned c = 0; c < 16; ++c) t.v[c] = e2m1_value(static_cast<std::uint8_t>(c));
      return t;
    }();
    return element_bits(s) == 4 ? e2m1 : e4m3;
  }
};

/// x rounded once into BF16 (to nearest, ties to even) at p: on the double's bits where x is a
/// normal BF16 value or zero, else through detail::encode_float_bits (subnormals, overflow, NaN).
inline void store_bf16(double x, std::byte* p) noexcept {
  const std::uint64_t u = std::bit_cast<std::uint64_t>(x);
  const int e = static_cast<int>((u >> 52) & 0x7FF) - 1023;
  std::uint16_t b;
  if (e >= -126 && e <= 127) {
    // keep 7 of the 52 mantissa bits: add half of the dropped part's unit (less one, plus the
    // kept part's lowest bit: ties to even), then drop it; a carry may raise the exponent
    const std::uint64_t r = u + ((std::uint64_t(1) << 44) - 1) + ((u >> 45) & 1);
    const int er = static_cast<int>((r >> 52) & 0x7FF) - 1023;
    if (er > 127) {
      b = static_cast<std::uint16_t>(((u >> 63) << 15) | 0x7F80);  // past the largest: infinity
    } else {
      b = static_cast<std::uint16_t>(((r >> 63) << 15) | (static_cast<std::uint64_t>(er + 127) << 7) |
                                     ((r >> 45) & 0x7F));
    }
  } else if ((u & ~(std::uint64_t(1) << 63)) == 0) {
    b = static_cast<std::uint16_t>((u >> 63) << 15);  // a signed zero
  } else {
    b = static_cast<std::uint16_t>(encode_float_bits(x, float_format_of(dtype::BF16)));
  }
  store_le(p, 2, b);
}

/// Writes view v's elements (dtype v.type) from the region's stored bytes: each the element times
/// its block's scale (and NVFP4's tensor scale), rounded once (core/quant.hpp).
inline void dequantize_view(const quantized_tensor& q, const flat_view& v, const dequant_region& g,
                            std::span<const std::byte> data, std::span<const std::byte> scale,
                            std::optional<double> tensor_scale, std::string_view where, unsigned threads) {
  const std::size_t k = q.shape.size();
  const std::uint64_t n = q.shape.back();
  const unsigned bits = element_bits(q.scheme);
  const std::size_t di = item_size(v.type), si = item_size(q.scale_type);
  // region widths: elements of a data row, scales of a scale row
  const std::uint64_t c_lo = g.flat ? 0 : g.lo.back(), c_hi = g.flat ? n : g.hi.back();
  const std::uint64_t width = c_hi - c_lo;
  const std::uint64_t s_lo = c_lo / q.block_cols, s_width = ceil_div(c_hi, q.block_cols) - s_lo;
  const std::uint64_t row_lo = g.flat ? g.r0 : (k >= 2 ? g.lo[k - 2] : 0);
  // the strides of the block region's leading dimensions, for a row's place in the region
  std::vector<std::uint64_t> dims(k > 0 ? k - 1 : 0), region(dims.size());
  for (std::size_t d = 0; d + 1 < k; ++d) {
    dims[d] = q.shape[d];
    if (!g.flat) region[d] = g.hi[d] - g.lo[d];
  }
  auto region_row = [&](std::uint64_t row) {  // the row's index among the region's rows
    if (g.flat) return row - g.r0;
    std::uint64_t rr = 0, stride = 1;
    for (std::size_t d = dims.size(); d-- > 0;) {
      const std::uint64_t i = row % dims[d];
      row /= dims[d];
      rr += (i - g.lo[d]) * stride;
      stride *= region[d];
    }
    return rr;
  };
  const double ts = tensor_scale.value_or(1.0);
  const shard_spec spec = v.spec ? *v.spec : shard_spec(block_spec::whole(q.shape));
  const element_table& table = element_table::of(q.scheme);
  const bool packed = bits == 4;
  auto bad_scale = [&](std::uint64_t row, std::uint64_t col) {
    const std::uint64_t at = (row_blocked(q.scheme) ? row / q.block_rows : row) * scale_row_len(q) + col / q.block_cols;
    fail(errc::invalid_metadata, std::string(where) + ": quantized weight '" + q.name + "': its scale '" + q.scale +
                                     "' at flat index " + std::to_string(at) +
                                     " is NaN or infinite (E8M0 0xFF, E4M3 S.1111.111): not a scale");
  };
  // each run of the view's shard, a row segment at a time: one row's place in the region, and
  // each block's scale decoded once
  // the shard's global elements [lo, hi) (its runs clipped to them): a task of the walk below
  auto walk_range = [&](auto store, std::uint64_t lo, std::uint64_t hi) {
    auto c = spec.cursor(q.shape);
    c.seek(lo);
    for (; !c.done(); c.next()) {
      const spec_run whole_run = c.run();
      if (whole_run.begin >= hi) break;
      if (whole_run.end <= lo) continue;
      const spec_run run{std::max(whole_run.begin, lo), std::min(whole_run.end, hi),
                         whole_run.local + (std::max(whole_run.begin, lo) - whole_run.begin)};
      std::byte* out = v.data + run.local * di;
      for (std::uint64_t gidx = run.begin; gidx < run.end;) {
        const std::uint64_t row = gidx / n, col0 = gidx % n, len = std::min(run.end - gidx, n - col0);
        const std::uint64_t rr = region_row(row), e0 = rr * width + (col0 - c_lo);
        const std::uint64_t srow = row_blocked(q.scheme) ? (row / q.block_rows - row_lo / q.block_rows) : rr;
        const std::byte* srow_at = scale.data() + srow * s_width * si;
        const auto* bytes = reinterpret_cast<const std::uint8_t*>(data.data());
        // a block of columns at a time, under one scale
        for (std::uint64_t j = 0; j < len;) {
          const std::uint64_t col = col0 + j, b = col / q.block_cols;
          const auto got = scale_value(q.scale_type, srow_at + (b - s_lo) * si);
          if (!got) bad_scale(row, col);
          const double sv = *got * ts;
          const std::uint64_t stop = std::min(len, (b + 1) * q.block_cols - col0);
          if (packed)
            for (std::uint64_t e = e0 + j, end = e0 + stop; e < end; ++e, out += di)
              store(table.v[(e & 1) ? bytes[e / 2] >> 4 : bytes[e / 2] & 0xF] * sv, out);
          else
            for (std::uint64_t e = e0 + j, end = e0 + stop; e < end; ++e, out += di) store(table.v[bytes[e]] * sv, out);
          j = stop;
        }
        gidx += len;
      }
    }
  };
  // the shard's global span cut in pieces of about 2^20 values (whole rows of the weight), on the
  // load's threads
  std::uint64_t first = 0, last = 0;
  {
    auto c = spec.cursor(q.shape);
    if (!c.done()) first = c.run().begin;
    for (; !c.done(); c.next()) last = c.run().end;
  }
  const std::uint64_t span = last > first ? last - first : 0;
  const std::uint64_t rows_per = std::max<std::uint64_t>(1, (std::uint64_t(1) << 20) / n);
  const std::uint64_t pieces = span == 0 ? 0 : ceil_div(span, rows_per * n);
  auto walk = [&](auto store) {
    if (pieces <= 1) return walk_range(store, first, last);
    parallel_for(static_cast<std::size_t>(pieces), threads, [&](std::size_t i) {
      const std::uint64_t lo = first + i * rows_per * n;
      walk_range(store, lo, std::min(last, lo + rows_per * n));
    });
  };
  // the product is exact (at most 30 significant bits; ts is 1 but for NVFP4, whose element x
  // block scale has at most 7 bits, so x * (s * ts) is x * s * ts rounded once); each store rounds
  // once into the view's dtype
  switch (v.type) {
    case dtype::F32:
      walk([](double x, std::byte* p) {
        const float f = static_cast<float>(x);  // one rounding, to nearest even
        std::memcpy(p, &f, 4);
      });
      break;
    case dtype::BF16: walk([](double x, std::byte* p) { store_bf16(x, p); }); break;
    default: walk([&](double x, std::byte* p) { store_float(v.type, x, p); });
  }
}

}  // namespace detail

/// Whether shardsafe::load dequantizes view v: a floating view (F16, BF16, F32, F64) whose name is a
/// quantized weight (find_quantized), or nullopt.
/// (`config`: find_quantized's, read once for many views.)
template <ReadableDirectory D>
std::optional<quantized_tensor> dequantized_by_load(const checkpoint_reader<D>& r, const flat_view& v,
                                                    std::optional<quant_config>& config) {
  if (!is_convertible_float(v.type)) return std::nullopt;
  const tensor_metadata* t = r.find(v.key);
  if (t && t->type != dtype::F8_E4M3 && t->type != dtype::U8) return std::nullopt;
  return find_quantized(r, v.key, config);
}

/// The views shardsafe::load dequantizes (dequantized_by_load), with their weights, by index
/// (config.json read at most once).
template <ReadableDirectory D>
std::vector<std::pair<std::size_t, quantized_tensor>> dequantized_views(const checkpoint_reader<D>& r,
                                                                        std::span<const flat_view> views) {
  std::vector<std::pair<std::size_t, quantized_tensor>> out;
  std::optional<quant_config> config;
  for (std::size_t i = 0; i < views.size(); ++i)
    if (auto q = dequantized_by_load(r, views[i], config)) out.emplace_back(i, std::move(*q));
  return out;
}

/// Loads views, the quantized weights among them (`found`: dequantized_views) dequantized into
/// their dtype: their stored elements and scales read (the rows or block each view needs, no more)
/// in the same plan as the other views, then each element times its scales, rounded once. Needs
/// opt.convert_dtypes (a quantized weight into a floating view is a conversion).
template <ReadableDirectory D>
load_stats load_dequantizing(checkpoint_reader<D>& r, std::span<const flat_view> views,
                             std::span<const std::pair<std::size_t, quantized_tensor>> found, const load_options& opt) {
  const std::string where(r.directory().name());
  std::vector<flat_view> all;
  struct pending {
    std::size_t view;
    quantized_tensor q;
    detail::dequant_region g;
    std::size_t data_view, scale_view, tensor_view;
  };
  std::vector<pending> todo;
  std::vector<std::vector<std::byte>> buffers;  // (a buffer's memory stays put as the vector grows)
  auto add = [&](const std::string& key, dtype t, const shape_t& full, std::optional<shard_spec> spec,
                 std::uint64_t bytes) {
    buffers.emplace_back(static_cast<std::size_t>(bytes));
    flat_view fv;
    fv.key = key;
    fv.type = t;
    fv.full_shape = full;
    fv.spec = std::move(spec);
    fv.data = buffers.back().data();
    fv.nbytes = bytes;
    all.push_back(std::move(fv));
    return all.size() - 1;
  };
  all.reserve(views.size() + 3 * found.size());
  for (std::size_t i = 0, next = 0; i < views.size(); ++i) {
    const flat_view& v = views[i];
    if (next == found.size() || found[next].first != i) {
      all.push_back(v);
      continue;
    }
    const quantized_tensor* q = &found[next++].second;
    if (!opt.convert_dtypes)
      fail(errc::dtype_mismatch, where + ": tensor '" + v.key + "' is a quantized weight (" +
                                     std::string(to_string(q->scheme)) + ", scale '" + q->scale + "'), asked for as " +
                                     std::string(to_string(v.type)) +
                                     ": set load_options::convert_dtypes to dequantize it while loading");
    if (v.full_shape != q->shape)
      fail(errc::shape_mismatch, where + ": tensor '" + v.key + "': the view is " + to_string(v.full_shape) +
                                     ", the quantized weight " + to_string(q->shape) + " (" +
                                     std::string(to_string(q->scheme)) + ", one element per value)");
    v.validate(where + ": tensor '" + v.key + "'");
    pending p{i, *q, detail::region_of(*q, v), 0, 0, SIZE_MAX};
    const tensor_metadata* dt = r.find(q->data);
    p.data_view = add(q->data, dt->type, q->data_shape, p.g.data, p.g.data_bytes);
    p.scale_view = add(q->scale, q->scale_type, q->scale_shape, p.g.scale, p.g.scale_count * item_size(q->scale_type));
    if (!q->tensor_scale.empty())
      p.tensor_view = add(q->tensor_scale, dtype::F32, r.find(q->tensor_scale)->shape, std::nullopt, 4);
    todo.push_back(std::move(p));
  }
  load_options o = opt;
  o.validate_nan = false;  // the stored bytes are read raw; the user's views are checked below
  if (opt.validate_nan)
    for (const auto& v : views) detail::fill_nan(v.type, v.bytes());
  load_stats st = r.execute(all, r.plan(all, o));
  for (const auto& p : todo) {
    const flat_view& v = views[p.view];
    std::optional<double> ts;
    if (p.tensor_view != SIZE_MAX) {
      ts = scale_value(dtype::F32, all[p.tensor_view].data);
      if (!ts)
        fail(errc::invalid_metadata, where + ": quantized weight '" + p.q.name + "': its per-tensor scale '" +
                                         p.q.tensor_scale + "' is NaN or infinite: not a scale");
    }
    detail::dequantize_view(p.q, v, p.g, all[p.data_view].bytes(), all[p.scale_view].bytes(), ts, where,
                            opt.threads ? opt.threads : detail::default_threads());
  }
  st.tensors = views.size();
  if (opt.validate_nan)
    for (const auto& v : views)
      if (detail::first_nan(v.type, v.bytes()) >= 0)
        fail(errc::missing_coverage,
             where + ": tensor '" + v.key + "': NaN after loading: not loaded, or NaN in the checkpoint");
  return st;
}

/// load_dequantizing with the views' quantized weights found here.
template <ReadableDirectory D>
load_stats load_dequantizing(checkpoint_reader<D>& r, std::span<const flat_view> views, const load_options& opt) {
  const auto found = dequantized_views(r, views);
  return load_dequantizing(r, views, std::span<const std::pair<std::size_t, quantized_tensor>>(found), opt);
}

}  // namespace shardsafe
