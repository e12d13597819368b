// shardsafe/checkpoint/quant.hpp - quantized weights and their scales as one thing (docs/FORMAT.md
// §8): which stored tensors make a block-scaled weight (find_quantized), and the shards of weight
// and scale that go together (quantized_shard_of). The load that dequantizes into F32, BF16, F16 or
// F64 views is checkpoint/dequant_load.hpp's (load_dequantizing, which shardsafe::load runs for
// such views).
//
// A weight is found by the name a view asks for (its logical name), from the stored tensors'
// names and dtypes and the folder's config.json:
//
// | asked for `W`  | stored                                            | scheme    | logical shape |
// |----------------|---------------------------------------------------|-----------|---------------|
// | `X.weight`     | `X.weight` F8_E4M3 [M, N], `X.weight_scale_inv`   | fp8_block | [M, N]        |
// |                | F32 [ceil(M/bm), ceil(N/bn)]; bm x bn from        |           |               |
// |                | config.json quantization_config.weight_block_size |           |               |
// |                | (else 128 x 128, DeepSeek-V3's)                   |           |               |
// | `X.weight`     | `X.weight` F8_E4M3 [M, N], `X.weight_scale` F32,  | fp8_channel | [M, N]      |
// |                | BF16 or F16 [M, 1] or [M] (compressed-tensors'    |           |               |
// |                | channel strategy, FBGEMM's FP8)                   |           |               |
// | `X.weight`     | `X.weight` F8_E4M3 [M, N], `X.weight_scale` F32,  | fp8_tensor | [M, N]       |
// |                | BF16 or F16 of one value ([], [1], [1, 1])        |           |               |
// | `X.weight`     | `X.weight` F8_E4M3 [..., N], `X.weight_scale`     | mxfp8     | [..., N]      |
// |                | F8_E8M0 or U8 [..., N/32]                         |           |               |
// | `X`            | `X_blocks` U8 [..., G, 16], `X_scales` U8 or      | mxfp4     | [..., G*32]   |
// |                | F8_E8M0 [..., G] (gpt-oss)                        |           |               |
// | `X.weight`     | `X.weight` U8 [..., N/2], `X.weight_scale`        | nvfp4     | [..., N]      |
// |                | F8_E4M3 [..., N/16], `X.weight_scale_2` F32 (one  |           |               |
// |                | element) (NVIDIA ModelOpt)                        |           |               |
//
// Refused, naming the tensor and the rule (errc::invalid_metadata): a scale of the wrong dtype or
// shape for its block, a missing tensor scale (NVFP4), an F8_E4M3 weight without a scale in a
// folder whose config.json has a quantization_config (its scale is missing), a fp8_block weight
// (or fp8_channel, fp8_tensor) that is not 2-D; at load time a NaN or infinite scale (E8M0's 0xFF included), naming its index.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/checkpoint/checkpoint_reader.hpp"
#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/checkpoint/load_options.hpp"
#include "shardsafe/shard/shard_spec.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/core/quant.hpp"
#include "shardsafe/detail/json_dom.hpp"
#include "shardsafe/storage/concepts.hpp"
#include "shardsafe/storage/text.hpp"

namespace shardsafe {

/// A block-scaled weight as a checkpoint stores it (the table at the top).
struct quantized_tensor {
  std::string name;          ///< its logical name: what a view asks for
  quant_scheme scheme{};     ///< how its elements and scales are encoded
  std::string data;          ///< the stored elements (`X.weight`, `X_blocks`)
  std::string scale;         ///< the block scales
  std::string tensor_scale;  ///< NVFP4's per-tensor scale (`X.weight_scale_2`); "" for the others
  dtype scale_type = dtype::F32;
  shape_t shape;        ///< logical: one element per value
  shape_t data_shape;   ///< as stored
  shape_t scale_shape;  ///< as stored
  std::uint64_t block_rows =
      1;  ///< rows (second-last dimension) a scale covers: fp8_block's bm, fp8_tensor's M, else 1
  std::uint64_t block_cols = 1;  ///< elements of the last dimension a scale covers (N for fp8_channel and fp8_tensor)
};

/// What a folder's config.json says of quantization: whether it has a quantization_config, and
/// fp8_block's block size (its weight_block_size, else 128 x 128). Read once for a walk over many
/// names (find_quantized's `config`).
struct quant_config {
  bool quantized = false;
  std::uint64_t block_rows = 128, block_cols = 128;
};

namespace detail {

/// dir's quant_config (no config.json: not quantized, 128 x 128).
template <ReadableDirectory D>
quant_config read_quant_config(const D& dir) {
  quant_config c;
  if (!dir.exists("config.json")) return c;
  const std::string text = read_text(dir.open("config.json"), 1 << 20);
  simdjson::dom::parser parser;
  const simdjson::dom::element root = parse_json(parser, text, std::string(dir.name()) + "/config.json");
  simdjson::dom::element qc;
  if (root["quantization_config"].get(qc) != simdjson::SUCCESS) return c;
  c.quantized = true;
  simdjson::dom::array wbs;
  if (qc["weight_block_size"].get(wbs) == simdjson::SUCCESS) {
    std::vector<std::uint64_t> v;
    for (simdjson::dom::element e : wbs) {
      std::uint64_t x = 0;
      if (e.get(x) != simdjson::SUCCESS || x == 0 || x > (1u << 20))
        fail(errc::invalid_metadata, std::string(dir.name()) +
                                         "/config.json: quantization_config.weight_block_size holds a value that is "
                                         "not a block length (1 to 2^20)");
      v.push_back(x);
    }
    if (v.size() != 2)
      fail(errc::invalid_metadata, std::string(dir.name()) +
                                       "/config.json: quantization_config.weight_block_size has " +
                                       std::to_string(v.size()) + " values, not 2 (rows, columns)");
    c.block_rows = v[0];
    c.block_cols = v[1];
  }
  return c;
}

inline std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) { return a / b + (a % b != 0); }

/// The scales of one row of a row_blocked weight's scale grid [ceil(M / bm), ceil(N / bn)] (1 for
/// fp8_channel and fp8_tensor), or of one row of the others' [..., N / block].
inline std::uint64_t scale_row_len(const quantized_tensor& q) { return ceil_div(q.shape.back(), q.block_cols); }

/// The block [off, off + size) of q's scales (over the grid above, or the others' scale shape) as a
/// shard of its scale tensor as stored: the block itself, or, for a scale stored as [M] or as one
/// value ([], [1]), the same elements as one flat range (its grid has one column, so a block of
/// its rows is contiguous).
inline shard_spec scale_as_stored(const quantized_tensor& q, const shape_t& off, const shape_t& size) {
  if (!row_blocked(q.scheme) || q.scale_shape.size() == 2) return block_spec(size, off);
  return flat_spec{{off[0], off[0] + size[0]}};
}

}  // namespace detail

/// The block-scaled weight a view named `name` asks for, or nullopt when `name` is none (a plain
/// tensor, or absent). Throws, naming the tensor and the rule, when its tensors do not agree.
/// `config`: the folder's quant_config, read into it when first needed (a walk over many names
/// passes one, so that config.json is read once).
template <ReadableDirectory D>
std::optional<quantized_tensor> find_quantized(const checkpoint_reader<D>& r, std::string_view name,
                                               std::optional<quant_config>& config) {
  auto cfg = [&]() -> const quant_config& {
    if (!config) config = detail::read_quant_config(r.directory());
    return *config;
  };
  const std::string where(r.directory().name());
  const std::string n(name);
  auto bad = [&](const std::string& what) -> void {
    fail(errc::invalid_metadata, where + ": quantized weight '" + n + "': " + what);
  };
  auto need = [&](const std::string& key, std::initializer_list<dtype> types, const char* what) {
    const tensor_metadata* t = r.find(key);
    if (!t) bad("its " + std::string(what) + " '" + key + "' is missing");
    if (std::find(types.begin(), types.end(), t->type) == types.end()) {
      std::string want;
      for (dtype d : types) want += (want.empty() ? "" : " or ") + std::string(to_string(d));
      bad("its " + std::string(what) + " '" + key + "' is " + std::string(to_string(t->type)) + ", not " + want);
    }
    return t;
  };
  auto shape_must = [&](const std::string& key, const shape_t& got, const shape_t& want, const std::string& rule) {
    if (got != want)
      bad("its scale '" + key + "' is " + to_string(got) + ", not " + to_string(want) + " (" + rule + ")");
  };
  quantized_tensor q;
  q.name = n;
  const tensor_metadata* w = r.find(n);
  if (!w) {
    // gpt-oss's MXFP4: X_blocks [..., G, 16] and X_scales [..., G]
    const tensor_metadata* blocks = r.find(n + "_blocks");
    if (!blocks) return std::nullopt;
    if (blocks->type != dtype::U8 || blocks->shape.size() < 2 || blocks->shape.back() != 16)
      bad("'" + n + "_blocks' is " + std::string(to_string(blocks->type)) + " " + to_string(blocks->shape) +
          ", not U8 [..., G, 16] (MXFP4: 32 E2M1 values a block, two a byte)");
    q.scheme = quant_scheme::mxfp4;
    q.data = n + "_blocks";
    q.scale = n + "_scales";
    const tensor_metadata* s = need(q.scale, {dtype::U8, dtype::F8_E8M0}, "scale");
    q.data_shape = blocks->shape;
    q.shape = shape_t(blocks->shape.begin(), blocks->shape.end() - 1);
    q.scale_shape = q.shape;
    q.shape.back() *= 32;
    shape_must(q.scale, s->shape, q.scale_shape, "one E8M0 scale per block of 32");
    q.scale_type = s->type;
    q.block_cols = 32;
    return q;
  }
  const std::string stem = n.ends_with("weight") ? n.substr(0, n.size() - 6) : std::string();
  if (w->type == dtype::F8_E4M3) {
    if (n.ends_with("_scale") || n.ends_with("_scale_inv")) return std::nullopt;  // a scale, not a weight
    q.data = n;
    q.data_shape = q.shape = w->shape;
    if (const tensor_metadata* s = r.find(n + "_scale_inv")) {  // DeepSeek-V3
      const std::uint64_t bm = cfg().block_rows, bn = cfg().block_cols;
      q.scheme = quant_scheme::fp8_block;
      q.scale = n + "_scale_inv";
      need(q.scale, {dtype::F32}, "scale");
      if (w->shape.size() != 2) bad("it is " + to_string(w->shape) + ": FP8 block scales are read for 2-D weights");
      q.block_rows = bm;
      q.block_cols = bn;
      q.scale_shape = {detail::ceil_div(w->shape[0], bm), detail::ceil_div(w->shape[1], bn)};
      shape_must(q.scale, s->shape, q.scale_shape,
                 "one F32 scale per " + std::to_string(bm) + " x " + std::to_string(bn) + " block");
      q.scale_type = dtype::F32;
      return q;
    }
    if (!stem.empty() && r.find(stem + "weight_scale")) {  // MXFP8, or FP8 per channel or per tensor
      q.scale = stem + "weight_scale";
      const tensor_metadata* s =
          need(q.scale, {dtype::F8_E8M0, dtype::U8, dtype::F32, dtype::BF16, dtype::F16}, "scale");
      q.scale_shape = s->shape;
      q.scale_type = s->type;
      if (is_convertible_float(s->type)) {  // compressed-tensors, FBGEMM: a value a row, or one
        if (w->shape.size() != 2)
          bad("it is " + to_string(w->shape) + ": FP8 scales per channel or per tensor are read for 2-D weights");
        const std::uint64_t m = w->shape[0], sn = s->numel();
        const bool per_row = s->shape == shape_t{m, 1} || s->shape == shape_t{m};
        if (sn == 1) {
          q.scheme = quant_scheme::fp8_tensor;
          q.block_rows = std::max<std::uint64_t>(m, 1);
        } else if (per_row) {
          q.scheme = quant_scheme::fp8_channel;
        } else {
          bad("its scale '" + q.scale + "' is " + to_string(s->shape) + ", not [" + std::to_string(m) + ",1] or [" +
              std::to_string(m) + "] (one scale a row: per channel) or one value (per tensor)");
        }
        q.block_cols = std::max<std::uint64_t>(w->shape[1], 1);
        return q;
      }
      q.scheme = quant_scheme::mxfp8;
      if (w->shape.empty() || w->shape.back() % 32)
        bad("it is " + to_string(w->shape) + ": MXFP8 blocks of 32 need a last dimension that is a multiple of 32");
      q.scale_shape = w->shape;
      q.scale_shape.back() /= 32;
      shape_must(q.scale, s->shape, q.scale_shape, "one E8M0 scale per block of 32");
      q.block_cols = 32;
      return q;
    }
    if (cfg().quantized)
      bad("it is F8_E4M3 and config.json has a quantization_config, but neither '" + n + "_scale_inv' nor '" + stem +
          "weight_scale' is there: its scale is missing (the values would be off by the scale)");
    return std::nullopt;
  }
  if (w->type == dtype::U8 && !stem.empty()) {
    const tensor_metadata* s = r.find(stem + "weight_scale");
    if (!s || s->type != dtype::F8_E4M3) return std::nullopt;
    q.scheme = quant_scheme::nvfp4;
    q.data = n;
    q.scale = stem + "weight_scale";
    q.tensor_scale = stem + "weight_scale_2";
    q.data_shape = w->shape;
    if (w->shape.empty()) bad("it is a scalar: NVFP4 weights are packed along their last dimension");
    q.shape = w->shape;
    q.shape.back() *= 2;
    if (q.shape.back() % 16) bad("its last dimension " + std::to_string(q.shape.back()) + " is not a multiple of 16");
    q.scale_shape = q.shape;
    q.scale_shape.back() /= 16;
    shape_must(q.scale, s->shape, q.scale_shape, "one F8_E4M3 scale per block of 16");
    q.scale_type = dtype::F8_E4M3;
    q.block_cols = 16;
    const tensor_metadata* g = need(q.tensor_scale, {dtype::F32}, "per-tensor scale");
    if (g->numel() != 1)
      bad("its per-tensor scale '" + q.tensor_scale + "' is " + to_string(g->shape) + ", not one value");
    return q;
  }
  return std::nullopt;
}

/// find_quantized reading config.json itself (for one name).
template <ReadableDirectory D>
std::optional<quantized_tensor> find_quantized(const checkpoint_reader<D>& r, std::string_view name) {
  std::optional<quant_config> config;
  return find_quantized(r, name, config);
}

/// The logical name of the quantized weight whose stored elements a tensor `key` of dtype t may be
/// (find_quantized says whether it is): `X` for a U8 `X_blocks`, the key for an F8_E4M3 tensor or
/// a U8 `X.weight`; nullopt for any other tensor, which is no quantized weight's elements.
inline std::optional<std::string> quantized_candidate(std::string_view key, dtype t) {
  if (t == dtype::U8 && key.ends_with("_blocks")) return std::string(key.substr(0, key.size() - 7));
  if (t == dtype::F8_E4M3 || (t == dtype::U8 && key.ends_with("weight"))) return std::string(key);
  return std::nullopt;
}

/// Every quantized weight of the checkpoint r has open, by logical name: find_quantized on each
/// stored name that may be one (quantized_candidate). Reads metadata and config.json only; throws
/// as find_quantized does.
template <ReadableDirectory D>
std::vector<quantized_tensor> quantized_tensors(const checkpoint_reader<D>& r) {
  std::vector<quantized_tensor> out;
  std::optional<quant_config> config;
  for (const auto& [key, tm] : r.metadata().tensors)
    if (const auto name = quantized_candidate(key, tm.type))
      if (auto q = find_quantized(r, *name, config)) out.push_back(std::move(*q));
  return out;
}

/// Every quantized weight of the checkpoint with its scales read and checked: each a finite
/// value (errc::invalid_metadata naming the scale tensor and the flat index otherwise). What
/// `verify` checks; reads the scales only (a sixteenth of the weights' elements at most).
template <ReadableDirectory D>
std::vector<quantized_tensor> check_quantized(checkpoint_reader<D>& r) {
  const std::string where(r.directory().name());
  std::vector<quantized_tensor> qs = quantized_tensors(r);
  for (const auto& q : qs)
    for (const std::string& key : {q.scale, q.tensor_scale}) {
      if (key.empty()) continue;
      const tensor_metadata& tm = *r.find(key);
      const std::size_t si = item_size(tm.type);
      const std::uint64_t n = tm.numel(), chunk = std::uint64_t(1) << 20;  // elements a read
      std::vector<std::byte> buf;
      for (std::uint64_t at = 0; at < n; at += chunk) {
        const std::uint64_t m = std::min(chunk, n - at);
        buf.resize(static_cast<std::size_t>(m * si));
        const flat_view v{key, tm.type, tm.shape, shard_spec(flat_spec{{at, at + m}}), buf.data(), buf.size()};
        r.execute(std::span<const flat_view>(&v, 1), r.plan(std::span<const flat_view>(&v, 1), load_options{}));
        for (std::uint64_t i = 0; i < m; ++i)
          if (!scale_value(tm.type, buf.data() + i * si))
            fail(errc::invalid_metadata, where + ": quantized weight '" + q.name + "': its scale '" + key +
                                             "' at flat index " + std::to_string(at + i) +
                                             " is NaN or infinite (E8M0 0xFF, E4M3 S.1111.111): not a scale");
      }
    }
  return qs;
}

/// The shards of a quantized weight's stored tensors that hold a shard of its logical tensor: what a
/// rank loads to keep the weight quantized (no dequantization), the scale going with the weight.
struct quantized_shard {
  shard_spec data;   ///< over quantized_tensor::data_shape
  shard_spec scale;  ///< over quantized_tensor::scale_shape
};

namespace detail {

/// The stored blocks of data and scale that hold the logical block [off, off + size) of q, whose
/// last dimension begins and ends on whole bytes (packed FP4) and MXFP4's blocks of 32: the scale
/// block covering it (every block it touches), as stored.
inline quantized_shard stored_blocks(const quantized_tensor& q, const shape_t& off, const shape_t& size) {
  const std::size_t k = q.shape.size();
  shape_t soff = off, ssize = size;
  soff[k - 1] = off[k - 1] / q.block_cols;
  ssize[k - 1] = ceil_div(off[k - 1] + size[k - 1], q.block_cols) - soff[k - 1];
  if (k >= 2) {
    soff[k - 2] = off[k - 2] / q.block_rows;
    ssize[k - 2] = ceil_div(off[k - 2] + size[k - 2], q.block_rows) - soff[k - 2];
  }
  shape_t doff = off, dsize = size;
  if (q.scheme == quant_scheme::mxfp4) {  // [..., G, 16]
    doff.back() /= 32;
    dsize.back() /= 32;
    doff.push_back(0);
    dsize.push_back(16);
  } else if (element_bits(q.scheme) == 4) {  // two values a byte
    doff.back() /= 2;
    dsize.back() /= 2;
  }
  return {block_spec(dsize, doff), scale_as_stored(q, soff, ssize)};
}

}  // namespace detail

/// The stored shards that hold exactly `logical` (over q.shape), refused (errc::invalid_spec,
/// naming the tensor, the dimension and the boundary) where a boundary cuts a scale block or a
/// byte of two packed FP4 values.
inline quantized_shard quantized_shard_of(const quantized_tensor& q, const shard_spec& logical) {
  logical.validate(q.shape, q.name);
  const std::size_t k = q.shape.size();
  const std::uint64_t n = q.shape.back();
  auto cut = [&](std::size_t dim, std::uint64_t at, std::uint64_t unit, const char* what) {
    fail(errc::invalid_spec, q.name + ": a shard boundary at " + std::to_string(at) + " of dimension " +
                                 std::to_string(dim) + " cuts " + what + " (" + std::string(to_string(q.scheme)) +
                                 ": boundaries on multiples of " + std::to_string(unit) +
                                 "); load it dequantized, or shard on block boundaries");
  };
  if (logical.is_block()) {
    const block_spec& b = logical.block();
    shape_t off = b.global_offset(), size = b.local_shape();
    for (std::size_t d = 0; d < k; ++d) {
      const std::uint64_t unit = d + 1 == k ? q.block_cols : (d + 2 == k ? q.block_rows : 1);
      for (std::uint64_t at : {off[d], off[d] + size[d]})
        if (at % unit && at != q.shape[d]) cut(d, at, unit, "a scale block");
    }
    return detail::stored_blocks(q, off, size);
  }
  // flat: each range begins and ends on a block (fp8_block: on a row that starts a block of rows)
  std::vector<element_range> d, s;
  const std::uint64_t rows_unit = q.block_rows * n;
  for (const auto& rg : logical.flat().ranges()) {
    if (rg.empty()) continue;
    const std::uint64_t total = numel(q.shape);
    for (std::uint64_t at : {rg.begin, rg.end}) {
      if (at == total) continue;
      if (row_blocked(q.scheme)) {
        if (at % rows_unit) cut(0, at / n, q.block_rows, "a block of rows (flat ranges hold whole blocks of rows)");
      } else if (at % q.block_cols) {
        cut(k - 1, at % n, q.block_cols, "a scale block");
      }
    }
    const unsigned bits = element_bits(q.scheme);
    d.push_back({rg.begin * bits / 8, rg.end * bits / 8});
    if (row_blocked(q.scheme)) {
      const std::uint64_t row_len = detail::scale_row_len(q);
      s.push_back({rg.begin / rows_unit * row_len, detail::ceil_div(rg.end, rows_unit) * row_len});
    } else {
      s.push_back({rg.begin / q.block_cols, rg.end / q.block_cols});
    }
  }
  return {flat_spec(std::move(d)), flat_spec(std::move(s))};
}

}  // namespace shardsafe
