// shardsafe/checkpoint/impl/description_message.ipp - description_message.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/checkpoint/description_message.hpp"

namespace shardsafe {
namespace detail {

SHARDSAFE_DECL void encode_description(message_writer& m, const checkpoint_metadata& md) {
  const auto& x = md.extras;
  if (!x.writer.empty() || x.world_size || !x.file_sizes.empty() || x.checksums)
    fail(errc::invalid_argument,
         "a rank's description of its views has no extras (writer, world size, file sizes, checksums)");
  m.count(md.tensors.size());
  for (const auto& [key, tm] : md.tensors) {
    if (tm.grid)
      fail(errc::invalid_argument,
           "tensor '" + key + "': a rank's description lists its files; it has no shardsafe_grid");
    m.text(key).counts(tm.shape).count(static_cast<std::uint64_t>(tm.type)).flag(tm.is_sharded);
    m.count(tm.files.size());
    for (const auto& [fname, spec] : tm.files) {
      m.text(fname);
      encode_shard_spec(m, spec);
    }
  }
}

SHARDSAFE_DECL checkpoint_metadata decode_description(message_reader& m) {
  checkpoint_metadata md;
  const std::uint64_t n = m.items(min_described_tensor_bytes, "tensors");
  md.tensors.reserve(static_cast<std::size_t>(n));
  for (std::uint64_t t = 0; t < n; ++t) {
    std::string key = m.text();
    const std::string c = "tensor '" + key + "'";
    tensor_metadata tm;
    tm.shape = m.counts();
    const auto elements = checked_numel(tm.shape);
    if (!elements) m.malformed(c + ": shape " + to_string(tm.shape) + " has more than 2^64 elements");
    tm.type = static_cast<dtype>(m.count(all_dtypes.size() - 1, c + "'s dtype"));
    if (!checked_mul(*elements, std::uint64_t(bit_size(tm.type))))
      m.malformed(c + ": shape " + to_string(tm.shape) + " " + std::string(to_string(tm.type)) +
                  " has more than 2^64 bits of data");
    tm.is_sharded = m.flag(c + "'s is_sharded");
    const std::uint64_t nf = m.items(16, "files of " + c);
    tm.files.reserve(static_cast<std::size_t>(nf));
    for (std::uint64_t f = 0; f < nf; ++f) {
      std::string fname = m.text();
      const std::string fc = c + ": file '" + fname + "'";
      if (!is_plain_name(fname)) m.malformed(fc + " is not a plain file name (no '/', '\\' or '..')");
      shard_spec spec = decode_shard_spec(m, fc + "'s shard spec");
      try {
        spec.validate(tm.shape, fc);
      } catch (const error& e) {
        m.malformed(e.what());
      }
      tm.files.emplace_back(std::move(fname), std::move(spec));
    }
    std::vector<std::string_view> names;
    names.reserve(tm.files.size());
    for (const auto& f : tm.files) names.push_back(f.first);
    std::sort(names.begin(), names.end());
    if (auto d = std::adjacent_find(names.begin(), names.end()); d != names.end())
      m.malformed(c + ": file '" + std::string(*d) + "' is listed twice");
    md.tensors.emplace_back(std::move(key), std::move(tm));
  }
  std::vector<std::string_view> keys;
  keys.reserve(md.tensors.size());
  for (const auto& t : md.tensors) keys.push_back(t.first);
  std::sort(keys.begin(), keys.end());
  if (auto d = std::adjacent_find(keys.begin(), keys.end()); d != keys.end())
    m.malformed("tensor '" + std::string(*d) + "' is described twice");
  return md;
}

}  // namespace detail
}  // namespace shardsafe
