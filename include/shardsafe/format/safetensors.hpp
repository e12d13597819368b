// shardsafe/format/safetensors.hpp - parse and validate a safetensors header (docs/FORMAT.md §1),
// and read whole tensors or element ranges of them straight into caller memory.
//
// The parser trusts nothing: the 8-byte length is bounded before anything is allocated, every
// number is checked for sign, integrality and overflow, and the tensors must tile the data
// buffer exactly. Every error names the file, the tensor and the rule it breaks.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/byte_range.hpp"
#include "shardsafe/core/dtype.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/core/shape.hpp"
#include "shardsafe/detail/checked.hpp"
#include "shardsafe/detail/json.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

/// The largest header length (the first 8 bytes) a reader accepts.
inline constexpr std::uint64_t max_header_size = 100'000'000;

/// One tensor of a safetensors file.
struct tensor_entry {
  std::string name;
  dtype type = dtype::U8;
  shape_t shape;
  std::uint64_t begin = 0;  ///< data_offsets[0], relative to the start of the data buffer
  std::uint64_t end = 0;    ///< data_offsets[1]

  std::uint64_t numel() const noexcept { return shardsafe::numel(shape); }
  std::uint64_t nbytes() const noexcept { return end - begin; }
};

/// A validated header: the tensors in data order and the __metadata__ map.
class safetensors_header {
 public:
  std::string file;                             ///< what messages call the file
  std::uint64_t header_size = 0;                ///< N, the JSON length
  std::uint64_t data_size = 0;                  ///< bytes of the data buffer
  std::vector<tensor_entry> tensors;            ///< sorted by data offset
  std::map<std::string, std::string> metadata;  ///< __metadata__, if any
  bool has_metadata = false;                    ///< whether __metadata__ was present

  std::uint64_t data_start() const noexcept { return prefix_ + header_size; }
  std::uint64_t file_size() const noexcept { return data_start() + data_size; }

  /// The tensor with this name, or nullptr.
  const tensor_entry* find(std::string_view name) const noexcept {
    auto it = std::lower_bound(by_name_.begin(), by_name_.end(), name,
                               [&](std::uint32_t i, std::string_view n) { return tensors[i].name < n; });
    if (it == by_name_.end() || tensors[*it].name != name) return nullptr;
    return &tensors[*it];
  }
  /// The tensor with this name; throws errc::not_found naming the file.
  const tensor_entry& at(std::string_view name) const {
    if (auto* t = find(name)) return *t;
    fail(errc::not_found, file + ": no tensor '" + std::string(name) + "'");
  }
  /// Absolute file offset of a tensor's first byte.
  std::uint64_t offset_of(const tensor_entry& t) const noexcept { return data_start() + t.begin; }

  /// The dimensions of tensor t, outermost first, in the order its bytes hold them, where that
  /// is not row-major: a chunk of a DCP data file that torch.save kept channels_last or
  /// transposed (of_records); empty for every safetensors file.
  std::span<const std::size_t> stored_order(const tensor_entry& t) const noexcept {
    const auto it = stored_orders_.find(t.name);
    return it == stored_orders_.end() ? std::span<const std::size_t>() : std::span<const std::size_t>(it->second);
  }

  /// Tensor names in sorted order.
  std::vector<std::string_view> names() const {
    std::vector<std::string_view> r;
    r.reserve(by_name_.size());
    for (auto i : by_name_) r.push_back(tensors[i].name);
    return r;
  }

  /// An index of tensors stored at absolute offsets of a file that is not a safetensors file
  /// (each chunk of a torch DCP data file, format/dcp_data.hpp): data_start() is 0, so
  /// offset_of(t) is t.begin, and file_size() is file_size. Names must be distinct
  /// (errc::invalid_metadata, naming `file`). stored_orders: by name, the records whose bytes
  /// hold their dimensions in another order (stored_order()).
  static safetensors_header of_records(
      std::string file, std::uint64_t file_size, std::vector<tensor_entry> records,
      std::map<std::string, std::vector<std::size_t>, std::less<>> stored_orders = {}) {
    safetensors_header h;
    h.stored_orders_ = std::move(stored_orders);
    h.file = std::move(file);
    h.prefix_ = 0;
    h.data_size = file_size;
    h.tensors = std::move(records);
    std::sort(h.tensors.begin(), h.tensors.end(), [](const tensor_entry& a, const tensor_entry& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.name < b.name;
    });
    h.index_names();
    return h;
  }

 private:
  friend safetensors_header parse_safetensors_header(std::string_view, std::uint64_t, std::string_view);
  void index_names() {
    by_name_.resize(tensors.size());
    for (std::uint32_t i = 0; i < by_name_.size(); ++i) by_name_[i] = i;
    std::sort(by_name_.begin(), by_name_.end(),
              [&](std::uint32_t a, std::uint32_t b) { return tensors[a].name < tensors[b].name; });
    for (std::size_t i = 1; i < by_name_.size(); ++i)
      if (tensors[by_name_[i]].name == tensors[by_name_[i - 1]].name)
        fail(errc::invalid_metadata, file + ": tensor '" + tensors[by_name_[i]].name + "' is listed twice");
  }
  std::uint64_t prefix_ = 8;            // bytes before the header: the length prefix, or 0 (of_records)
  std::vector<std::uint32_t> by_name_;  // indices into tensors, sorted by name
  std::map<std::string, std::vector<std::size_t>, std::less<>> stored_orders_;  // of_records': stored_order()
};

namespace detail {

inline std::string tensor_context(std::string_view file, std::string_view tensor) {
  std::string s(file);
  s += ": tensor '";
  s += tensor;
  s += "'";
  return s;
}

}  // namespace detail

/// Validates the JSON header `json` (the N bytes after the length prefix) of a file of
/// `file_size` bytes. `file` names the file in messages.
SHARDSAFE_DECL safetensors_header parse_safetensors_header(std::string_view json, std::uint64_t file_size,
                                                           std::string_view file);

/// Decodes the little-endian header length from the first 8 bytes.
inline std::uint64_t decode_header_length(std::span<const std::byte, 8> b) noexcept {
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | std::to_integer<std::uint64_t>(b[i]);
  return n;
}

/// Checks the length prefix against the limit and the file size; returns N.
inline std::uint64_t check_header_length(std::uint64_t n, std::uint64_t file_size, std::string_view file) {
  const std::string f(file);
  if (n > max_header_size)
    fail(errc::invalid_header, f + ": header length " + std::to_string(n) + " exceeds the limit of " +
                                   std::to_string(max_header_size) + " bytes");
  if (n > file_size - 8)
    fail(errc::truncated, f + ": header length " + std::to_string(n) + " runs past the end of the file (" +
                              std::to_string(file_size) + " bytes)");
  return n;
}

/// Parses a whole safetensors file held in memory.
SHARDSAFE_DECL safetensors_header parse_safetensors(std::span<const std::byte> file_bytes, std::string_view file);

/// Bytes read_safetensors_header asks for in its first read: enough for the headers of most
/// files (8 + N; a header with a few thousand tensors), so opening one costs one read.
inline constexpr std::uint64_t header_probe_bytes = std::uint64_t(64) << 10;

/// Reads and validates the header of a safetensors file in any readable storage: one read of
/// the first min(size, header_probe_bytes) bytes, and a second one only for the rest of a
/// header longer than that. Allocates at most that probe or the checked header length.
template <ReadableStorage S>
safetensors_header read_safetensors_header(const S& s) {
  const std::uint64_t size = s.size();
  const std::string_view file = s.name();
  if (size < 8)
    fail(errc::truncated,
         std::string(file) + ": file is " + std::to_string(size) + " bytes, shorter than the 8-byte header length");
  std::string buf(static_cast<std::size_t>(std::min(size, header_probe_bytes)), '\0');
  s.read_into(0, std::as_writable_bytes(std::span(buf)));
  const std::uint64_t n =
      check_header_length(decode_header_length(std::as_bytes(std::span(buf)).template first<8>()), size, file);
  const std::uint64_t have = buf.size();
  if (8 + n > have) {
    buf.resize(static_cast<std::size_t>(8 + n));
    s.read_into(have, std::as_writable_bytes(std::span(buf)).subspan(static_cast<std::size_t>(have)));
  }
  return parse_safetensors_header(std::string_view(buf).substr(8, static_cast<std::size_t>(n)), size, file);
}

/// Byte range in the file of elements [first, first + count) of tensor t.
inline byte_range element_byte_range(const safetensors_header& h, const tensor_entry& t, std::uint64_t first,
                                     std::uint64_t count) {
  const std::string ctx = detail::tensor_context(h.file, t.name);
  require_byte_sized(t.type, ctx);
  const std::uint64_t n = t.numel();
  if (first > n || count > n - first)
    fail(errc::invalid_argument, ctx + ": element range " + to_string(element_range{first, first + count}) +
                                     " is outside its " + std::to_string(n) + " elements");
  const std::uint64_t isz = item_size(t.type);
  const std::uint64_t b = h.offset_of(t) + first * isz;
  return {b, b + count * isz};
}

/// Reads elements [first, first + dst.size() / itemsize) of tensor t into dst, in place.
template <ReadableStorage S>
void read_elements(const S& s, const safetensors_header& h, const tensor_entry& t, std::uint64_t first,
                   std::span<std::byte> dst) {
  require_byte_sized(t.type, detail::tensor_context(h.file, t.name));
  const std::uint64_t isz = item_size(t.type);
  if (dst.size() % isz != 0)
    fail(errc::invalid_argument, detail::tensor_context(h.file, t.name) + ": destination of " +
                                     std::to_string(dst.size()) + " bytes is not a whole number of " +
                                     std::string(to_string(t.type)) + " elements");
  const byte_range r = element_byte_range(h, t, first, dst.size() / isz);
  s.read_into(r.begin, dst);
}

/// Reads all of tensor t (any dtype, sub-byte ones included) into dst, which must be exactly
/// t.nbytes() long.
template <ReadableStorage S>
void read_tensor(const S& s, const safetensors_header& h, const tensor_entry& t, std::span<std::byte> dst) {
  if (dst.size() != t.nbytes())
    fail(errc::invalid_argument, detail::tensor_context(h.file, t.name) + ": destination of " +
                                     std::to_string(dst.size()) + " bytes, tensor has " + std::to_string(t.nbytes()));
  s.read_into(h.offset_of(t), dst);
}

}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/format/impl/safetensors.ipp"
#endif
