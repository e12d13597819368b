// shardsafe/format/dcp_data.hpp - where the chunks of one torch DCP data file lie (docs/FORMAT.md
// §5, issue 11): the index the checkpoint reader plans its reads from.
//
// `.metadata` (format/dcp_metadata.hpp) says which byte range of which data file holds each
// chunk. A `.distcp` range is one torch.save archive (format/torch_zip.hpp): its storage record
// is found by the archive's zip headers and checked against its data.pkl, and then the chunk is
// an N-D block of dense bytes at a known offset of the file, which is all the overlap engine and
// the read plans need (row-major, or in the order of dimensions torch.save kept for a
// channels_last or transposed tensor: safetensors_header::stored_order). Newer torch can write
// the data files as safetensors instead (SerializationFormat.SAFETENSORS): then the file's own
// header places each chunk, and its DCP_SHARDING_INFO (format/dcp_sharding.hpp), when present,
// must agree with `.metadata`.
//
// The index is a safetensors_header made with of_records (offsets absolute in the file), one
// entry per chunk named by its key: a file holding two chunks of one key is described as two
// data files (two names, same path; checkpoint/source.hpp names them).
//
// Reads per archive: its first and last 2 KiB (one read when it is under 4 KiB), which hold
// the zip headers and data.pkl of a torch.save archive; a larger central directory, data.pkl or
// a longer name costs one more read each. No chunk's data is read.
//
// Rules (errc::truncated for a range past the end of the file; otherwise
// errc::invalid_metadata, naming the file, the range, the key and the rule): those of
// torch_zip.hpp; data.pkl is at most 1 MiB; a safetensors data file holds each chunk under its
// key with the chunk's dtype and sizes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/dtype.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/core/shape.hpp"
#include "shardsafe/detail/checked.hpp"
#include "shardsafe/format/dcp_metadata.hpp"
#include "shardsafe/format/dcp_sharding.hpp"
#include "shardsafe/format/safetensors.hpp"
#include "shardsafe/format/torch_zip.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

/// One chunk of a tensor as `.metadata` places it in a data file.
struct dcp_file_chunk : dcp_block {
  std::uint64_t offset = 0;  ///< the archive's byte range in the file (.distcp)
  std::uint64_t length = 0;
  /// The name a layout built on DCP presents the chunk under ("": its key), and the leading axes
  /// (each of size 1 in the chunk) it drops: Megatron-Core's stacked layers, one layer a chunk.
  std::string presented;
  std::size_t dropped_axes = 0;
};

/// A data file of a DCP folder and the chunks it holds (each key at most once).
struct dcp_data_file {
  std::string path;          ///< the file's name in the folder
  bool safetensors = false;  ///< a safetensors file (newer torch), not torch.save archives
  std::vector<dcp_file_chunk> chunks;
};

/// The largest data.pkl read from an archive: torch's pickle of one tensor is a few hundred bytes.
inline constexpr std::uint64_t max_torch_tensor_pickle = std::uint64_t(1) << 20;

namespace detail {

/// The index entry of one torch.save archive holding chunk c (rules at the top); stored_order:
/// the order of dimensions its bytes hold (check_torch_zip_tensor).
template <ReadableStorage S>
tensor_entry index_torch_archive(const S& st, const dcp_file_chunk& c, const std::string& file,
                                 std::vector<std::size_t>& stored_order) {
  const std::string what =
      file + " [" + std::to_string(c.offset) + ", +" + std::to_string(c.length) + ") ('" + c.key + "')";
  if (c.length < 22)
    fail(errc::invalid_metadata, what + ": " + std::to_string(c.length) + " bytes are too few for a zip archive");
  const auto end = checked_add(c.offset, c.length);
  if (!end || *end > st.size())
    fail(errc::truncated, what + ": the range passes the end of the file (" + std::to_string(st.size()) + " bytes)");
  // the archive's two ends, read once: the zip headers and data.pkl are there
  constexpr std::uint64_t window = 2048;
  const std::string head =
      read_string(st, c.offset, static_cast<std::size_t>(c.length <= 2 * window ? c.length : window));
  const std::string tail =
      c.length > 2 * window ? read_string(st, c.offset + c.length - window, window) : std::string();
  auto read_at = [&](std::uint64_t off, std::size_t n) -> std::string {
    if (off + n <= head.size()) return head.substr(static_cast<std::size_t>(off), n);
    if (!tail.empty() && off >= c.length - window)
      return tail.substr(static_cast<std::size_t>(off - (c.length - window)), n);
    return read_string(st, c.offset + off, n);
  };
  const auto bytes = checked_mul(numel(c.sizes), item_size(c.type));
  if (!bytes) fail(errc::invalid_metadata, what + ": chunk of " + to_string(c.sizes) + " overflows 64 bits");
  const torch_zip_archive z = locate_torch_zip(c.length, read_at, what, *bytes);
  if (!z.pickle) fail(errc::invalid_metadata, what + ": no stored data.pkl next to '" + z.storage.name + "'");
  if (z.pickle->size > max_torch_tensor_pickle)
    fail(errc::invalid_metadata, what + ": data.pkl of " + std::to_string(z.pickle->size) + " bytes is larger than " +
                                     std::to_string(max_torch_tensor_pickle) + " (one tensor's pickle is far smaller)");
  const torch_zip_tensor t = parse_torch_tensor_pickle(
      read_at(z.pickle->data_offset, static_cast<std::size_t>(z.pickle->size)), what + ": data.pkl");
  stored_order = check_torch_zip_tensor(t, z.storage, c.type, c.sizes, what);
  tensor_entry e;
  e.name = c.key;
  e.type = c.type;
  e.shape = c.sizes;
  e.begin = c.offset + z.storage.data_offset;
  e.end = e.begin + z.storage.size;
  return e;
}

}  // namespace detail

/// The largest non-tensor item read from a DCP data file (its torch.save archive): an optimizer's
/// param group, with its list of parameter names, is far smaller.
inline constexpr std::uint64_t max_dcp_object_bytes = std::uint64_t(64) << 20;

namespace detail {
/// A non-tensor item's archive, read and located once: what read_dcp_object_archive returns and
/// read_dcp_object decodes.
struct dcp_object_bytes {
  std::string ctx;      ///< how messages name the item
  std::string archive;  ///< the torch.save archive, as the data file holds it
  torch_zip_archive z;  ///< where its data.pkl is
};

/// `opaque`: the archive may hold storages (tensors) too; only its zip directory and its one
/// PREFIX/data.pkl are checked, and `z` is not set.
template <ReadableStorage S>
dcp_object_bytes read_dcp_object_bytes(const S& st, const dcp_storage_info& where, const std::string& what,
                                       bool opaque = false) {
  dcp_object_bytes b;
  b.ctx = std::string(st.name()) + " [" + std::to_string(where.offset) + ", +" + std::to_string(where.length) + ") (" +
          what + ")";
  if (where.length > max_dcp_object_bytes)
    fail(errc::invalid_metadata, b.ctx + ": a non-tensor item of " + std::to_string(where.length) +
                                     " bytes passes the limit of " + std::to_string(max_dcp_object_bytes));
  const auto end = checked_add(where.offset, where.length);
  if (!end || *end > st.size())
    fail(errc::truncated, b.ctx + ": the range passes the end of the file (" + std::to_string(st.size()) + " bytes)");
  b.archive = read_string(st, where.offset, static_cast<std::size_t>(where.length));
  if (!opaque) {
    b.z = locate_torch_zip(b.archive, b.ctx, torch_zip_value);
    return b;
  }
  auto read_at = [&](std::uint64_t off, std::size_t n) { return b.archive.substr(static_cast<std::size_t>(off), n); };
  auto bad = [&](const std::string& rule) { fail(errc::invalid_metadata, b.ctx + ": " + rule); };
  const zip_directory dir = read_zip_directory(b.archive.size(), read_at, bad, 1024, 1 << 20, "a torch.save archive");
  std::size_t pickles = 0;
  for (const auto& e : dir.entries) pickles += e.name.ends_with("/data.pkl") && e.name.find('/') == e.name.size() - 9;
  if (pickles != 1) bad("holds " + std::to_string(pickles) + " PREFIX/data.pkl records, not one");
  return b;
}
}  // namespace detail

/// The bytes of a non-tensor item of a DCP folder as its data file holds them: [where.offset,
/// +where.length) of st, checked to be a torch.save archive of a pickled value (its data.pkl
/// alone: no storage record), not decoded. What an export copies unchanged, whatever object
/// without tensors the value pickles. `what` names the item in messages.
template <ReadableStorage S>
std::string read_dcp_object_archive(const S& st, const dcp_storage_info& where, const std::string& what,
                                    bool opaque = false) {
  return std::move(detail::read_dcp_object_bytes(st, where, what, opaque).archive);
}

/// The value of a non-tensor item of a DCP folder (read_dcp_object_archive), decoded: a pickled
/// plain value (None, bool, int, float, str, tuple, list, dict; any global, a tensor among them,
/// is refused by name).
template <ReadableStorage S>
pickle_value read_dcp_object(const S& st, const dcp_storage_info& where, const std::string& what) {
  const detail::dcp_object_bytes b = detail::read_dcp_object_bytes(st, where, what);
  return pickle_loads(std::string_view(b.archive).substr(static_cast<std::size_t>(b.z.pickle->data_offset),
                                                         static_cast<std::size_t>(b.z.pickle->size)),
                      b.ctx + ": data.pkl");
}

/// The index of data file f opened as st (rules at the top): one entry per chunk, named by its
/// key, at its absolute offset in the file.
template <ReadableStorage S>
safetensors_header index_dcp_data_file(const S& st, const dcp_data_file& f) {
  const std::string file(st.name());
  if (f.safetensors) {
    safetensors_header h = read_safetensors_header(st);
    const dcp_block_offsets at = is_dcp_sharded_header(h) ? parse_dcp_sharding_info(h) : dcp_block_offsets{};
    for (const auto& c : f.chunks) {
      const std::string ctx = file + ": tensor '" + c.key + "'";
      if (!c.presented.empty() || c.dropped_axes)
        fail(errc::invalid_metadata, ctx + ": presented as '" + c.presented +
                                         "', which a safetensors data file "
                                         "(named by its keys) cannot hold");
      const tensor_entry* e = h.find(c.key);
      if (!e) fail(errc::invalid_metadata, ctx + ": .metadata places a chunk here but the file does not hold it");
      if (e->type != c.type || e->shape != c.sizes)
        fail(errc::invalid_metadata, ctx + ": file holds " + std::string(to_string(e->type)) + " " +
                                         to_string(e->shape) + ", .metadata's chunk is " +
                                         std::string(to_string(c.type)) + " " + to_string(c.sizes));
      if (auto it = at.find(c.key); it != at.end() && it->second != c.offsets)
        fail(errc::invalid_metadata, ctx + ": DCP_SHARDING_INFO places the block at " + to_string(it->second) +
                                         ", .metadata at " + to_string(c.offsets));
    }
    return h;
  }
  std::vector<tensor_entry> entries;
  entries.reserve(f.chunks.size());
  std::map<std::string, std::vector<std::size_t>, std::less<>> orders;
  for (const auto& c : f.chunks) {
    std::vector<std::size_t> order;
    tensor_entry& e = entries.emplace_back(detail::index_torch_archive(st, c, file, order));
    if (c.dropped_axes) {  // size-1 axes: the same bytes, the order of the others kept
      const std::size_t d = std::min(c.dropped_axes, e.shape.size());
      e.shape.erase(e.shape.begin(), e.shape.begin() + static_cast<std::ptrdiff_t>(d));
      std::vector<std::size_t> kept;
      for (std::size_t a : order)
        if (a >= d) kept.push_back(a - d);
      bool row_major = true;
      for (std::size_t i = 0; i < kept.size(); ++i) row_major = row_major && kept[i] == i;
      order = row_major ? std::vector<std::size_t>{} : std::move(kept);
    }
    if (!c.presented.empty()) e.name = c.presented;
    if (!order.empty()) orders.emplace(e.name, std::move(order));
  }
  return safetensors_header::of_records(file, st.size(), std::move(entries), std::move(orders));
}

}  // namespace shardsafe
