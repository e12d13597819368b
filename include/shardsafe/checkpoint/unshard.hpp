// shardsafe/checkpoint/unshard.hpp - full tensors out of a sharded checkpoint, in one process.
//
// The loader does the work: a chunk [a, b) of a full tensor is just a flat shard
// {[a, b)}, so reading full tensors chunk by chunk keeps memory bounded by the chunk size
// whatever the tensor size, and reads only what each chunk needs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/format/safetensors_writer.hpp"

namespace shardsafe {

struct unshard_options {
  load_options load{};
  std::uint64_t chunk_bytes = std::uint64_t(64) << 20;  ///< memory per chunk
};

/// Calls f(bytes, first_element) for consecutive chunks of the full tensor `key`, in order.
/// A tensor with no elements gets no call.
template <ReadableDirectory D, class F>
void for_each_full_chunk(checkpoint_reader<D>& r, const std::string& key, F&& f, const unshard_options& opt = {}) {
  const tensor_metadata* tm = r.find(key);
  if (!tm) fail(errc::not_found, std::string(r.directory().name()) + ": tensor '" + key + "' is not in the checkpoint");
  require_byte_sized(tm->type, std::string(r.directory().name()) + ": tensor '" + key + "'");
  const std::uint64_t n = tm->numel(), item = item_size(tm->type);
  if (n == 0) return;
  const std::uint64_t per = std::max<std::uint64_t>(1, opt.chunk_bytes / item);
  std::vector<std::byte> buf(static_cast<std::size_t>(std::min(n, per) * item));
  for (std::uint64_t a = 0; a < n; a += per) {
    const std::uint64_t b = std::min(n, a + per);
    flat_view v{key, tm->type, tm->shape, shard_spec(flat_spec{{a, b}}), buf.data(), (b - a) * item};
    r.load(std::span<const flat_view>(&v, 1), opt.load);
    f(std::span<const std::byte>(buf.data(), static_cast<std::size_t>((b - a) * item)), a);
  }
}

/// Loads the full tensor `key` into out (numel * itemsize bytes).
template <ReadableDirectory D>
void unshard_tensor(checkpoint_reader<D>& r, const std::string& key, std::span<std::byte> out,
                    const load_options& opt = {}) {
  const tensor_metadata* tm = r.find(key);
  if (!tm) fail(errc::not_found, std::string(r.directory().name()) + ": tensor '" + key + "' is not in the checkpoint");
  flat_view v{key, tm->type, tm->shape, std::nullopt, out.data(), out.size()};
  r.load(std::span<const flat_view>(&v, 1), opt);
}

/// One source of full tensors for unshard_to_safetensors: a checkpoint and a name prefix.
template <ReadableDirectory D>
struct unshard_source {
  checkpoint_reader<D>* reader;
  std::string prefix;  ///< prepended to every tensor name in the output ("" or "model/")
};

/// Writes the full tensors of the sources into one safetensors file, chunk by chunk.
template <ReadableDirectory D, RandomAccessWritableStorage W>
std::uint64_t unshard_to_safetensors(std::span<const unshard_source<D>> sources, W& out,
                                     const unshard_options& opt = {},
                                     const std::map<std::string, std::string>& metadata = {}) {
  std::vector<tensor_entry> entries;
  for (const auto& s : sources)
    for (const auto& [key, tm] : s.reader->metadata().tensors) entries.push_back({s.prefix + key, tm.type, tm.shape, 0, 0});
  auto layout = plan_safetensors(std::move(entries), metadata, out.name());
  if constexpr (requires { out.reserve(std::uint64_t{}); }) out.reserve(layout.file_size());
  safetensors_writer<W> w(out, layout);
  for (const auto& s : sources)
    for (const auto& [key, tm] : s.reader->metadata().tensors) {
      const std::size_t idx = layout.index_of(s.prefix + key);
      const std::uint64_t item = item_size(tm.type);
      for_each_full_chunk(*s.reader, key, [&](std::span<const std::byte> bytes, std::uint64_t first) {
        w.write_part(idx, first * item, bytes);
      }, opt);
    }
  w.finish();
  return layout.file_size();
}

}  // namespace shardsafe
