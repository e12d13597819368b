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
#include <functional>
#include <map>
#include <optional>
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
/// The most tensors a reader accepts in one file (docs/FORMAT.md §1): a header of 100 MB holds
/// up to two million, whose index and the structures the tool's commands build from it would
/// pass 1 GiB; refused as the entry past it is read.
inline constexpr std::uint64_t max_tensors_per_file = std::uint64_t(1) << 16;
/// The most bytes the names of one file's tensors may take together (docs/FORMAT.md §1): 64 a name
/// at max_tensors_per_file. The exports keep a name in several structures (about 14 bytes of
/// memory a byte of name): 65,536 names filling a 100 MB header took `to-hf` 1.4 GiB.
inline constexpr std::uint64_t max_tensor_name_bytes_per_file = std::uint64_t(4) << 20;
/// The most JSON text one member of a header's object (a tensor's entry, or __metadata__) may
/// take (docs/FORMAT.md §1): a member is parsed whole, and a 99 MB __metadata__ value took
/// `inspect` 420 MiB, every other command 300 MiB.
inline constexpr std::uint64_t max_header_member_bytes = std::uint64_t(16) << 20;

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

namespace detail {
class safetensors_header_reader;
}

/// What a reader keeps of a header it validates whole (read_safetensors_header): the tensors
/// `tensor` accepts (every one where it is empty) and __metadata__ where `metadata`. The rest is
/// checked by every rule (names given once, the tiling of the data buffer) and then let go: a
/// checkpoint's reader keeps of each rank file only what its description lists there, so that
/// a checkpoint of many files, hard links of one file at every cap among them, holds no more
/// than its description names.
struct header_keep {
  std::function<bool(std::string_view)> tensor;
  bool metadata = true;
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
  friend class detail::safetensors_header_reader;
  // twice: the message for a name listed twice (of_records': invalid_metadata; a header's:
  // invalid_header, as any key of its top level given twice)
  void index_names(bool header = false) {
    by_name_.resize(tensors.size());
    for (std::uint32_t i = 0; i < by_name_.size(); ++i) by_name_[i] = i;
    std::sort(by_name_.begin(), by_name_.end(),
              [&](std::uint32_t a, std::uint32_t b) { return tensors[a].name < tensors[b].name; });
    for (std::size_t i = 1; i < by_name_.size(); ++i)
      if (tensors[by_name_[i]].name == tensors[by_name_[i - 1]].name) {
        const std::string& n = tensors[by_name_[i]].name;
        if (header) fail(errc::invalid_header, file + ": name '" + n + "' appears twice in the header");
        fail(errc::invalid_metadata, file + ": tensor '" + n + "' is listed twice");
      }
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

namespace detail {

/// Reads a header's JSON a piece at a time, in the memory of its largest top-level member (one
/// tensor's entry, or __metadata__) and the index it builds, never the whole text or a DOM of it:
/// a scan that tracks strings and nesting splits the top-level object into its members, and each
/// member is parsed (simdjson's DOM, as `{member}`) and checked as it ends. feed() the N bytes in
/// order, in pieces of any size, then finish().
class safetensors_header_reader {
 public:
  SHARDSAFE_DECL safetensors_header_reader(std::string_view file, std::uint64_t header_size);
  /// Keeps only what `keep` says in the header finish() returns (every rule is checked on all).
  void keep_only(header_keep keep) { keep_ = std::move(keep); }
  /// The next bytes of the header text.
  SHARDSAFE_DECL void feed(std::string_view text);
  /// The validated header of a file of file_size bytes, once all N bytes were fed.
  SHARDSAFE_DECL safetensors_header finish(std::uint64_t file_size);

 private:
  [[noreturn]] SHARDSAFE_DECL void not_json(const std::string& why) const;
  SHARDSAFE_DECL void end_member(bool closing);
  SHARDSAFE_DECL void add(std::string_view key, simdjson::dom::element value);
  safetensors_header h_;
  header_keep keep_;
  // the tensors keep_ let go: their data offsets and names (in dropped_names_), for finish()'s rules
  struct dropped {
    std::uint64_t begin, end, at, size;
  };
  std::vector<dropped> dropped_;
  std::string dropped_names_;
  std::string member_ = "{";     // "{" and the text of the member being read
  std::uint64_t at_ = 0;         // header bytes fed so far
  std::uint64_t member_at_ = 0;  // where the member being read starts in the header
  enum { before, inside, after } where_ = before;
  bool in_string_ = false, escaped_ = false, comma_ = false, metadata_seen_ = false;
  std::size_t depth_ = 0;  // nesting within the member being read
  std::uint64_t members_ = 0;
  std::uint64_t name_bytes_ = 0;  ///< of the tensors' names so far (max_tensor_name_bytes_per_file)
  simdjson::dom::parser parser_;
  std::optional<error> duplicate_;  // a key given twice within a member: thrown after the other rules
};

}  // namespace detail

/// Validates the JSON header `json` (the N bytes after the length prefix) of a file of
/// `file_size` bytes. `file` names the file in messages. (detail::safetensors_header_reader.)
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

/// Bytes of a header read_safetensors_header reads at a time past the probe.
inline constexpr std::uint64_t header_window_bytes = std::uint64_t(4) << 20;

/// Reads and validates the header of a safetensors file in any readable storage: one read of
/// the first min(size, header_probe_bytes) bytes, and for a header longer than that the rest
/// in reads of header_window_bytes, each parsed as it comes (detail::safetensors_header_reader):
/// the text is never held whole. `keep`: what of it to keep (header_keep; all by default).
template <ReadableStorage S>
safetensors_header read_safetensors_header(const S& s, header_keep keep = {}) {
  const std::uint64_t size = s.size();
  const std::string_view file = s.name();
  if (size < 8)
    fail(errc::truncated,
         std::string(file) + ": file is " + std::to_string(size) + " bytes, shorter than the 8-byte header length");
  std::string buf(static_cast<std::size_t>(std::min(size, header_probe_bytes)), '\0');
  s.read_into(0, std::as_writable_bytes(std::span(buf)));
  const std::uint64_t n =
      check_header_length(decode_header_length(std::as_bytes(std::span(buf)).template first<8>()), size, file);
  detail::safetensors_header_reader r(file, n);
  r.keep_only(std::move(keep));
  std::uint64_t at = std::min<std::uint64_t>(buf.size(), 8 + n);  // header bytes [8, at) are in buf
  r.feed(std::string_view(buf).substr(8, static_cast<std::size_t>(at - 8)));
  if (at < 8 + n) buf.resize(static_cast<std::size_t>(std::min(header_window_bytes, 8 + n - at)));
  while (at < 8 + n) {
    const std::size_t len = static_cast<std::size_t>(std::min<std::uint64_t>(buf.size(), 8 + n - at));
    s.read_into(at, std::as_writable_bytes(std::span(buf)).first(len));
    r.feed(std::string_view(buf).substr(0, len));
    at += len;
  }
  buf = std::string();
  return r.finish(size);
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
